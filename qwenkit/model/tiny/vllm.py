"""Tiny checkpoints with the shapes vLLM's CPU kernels take: the vLLM tests' models.

vLLM's CPU attention needs a head dim in {32, 64, 80, ..., 512}; the tiny default
(:mod:`qwenkit.model.tiny.checkpoint`) has 16 (64 wide, 4 heads) in its text decoder and its vision tower, and
other tests and recipes depend on its shapes. :func:`ensure_checkpoint` writes the same family's
tiny checkpoint (the same tokenizer, processor, layers and token ids) twice as wide: text 128 wide
with head dim 32 (mRoPE's sections summing to 16; Qwen3.5 keeps its partial rotary sections), vision 64
wide with head dim 32, and Qwen3.5's linear-attention key and value heads 128 wide (vLLM's CPU Gated
DeltaNet takes no other, and runs bf16 only). It is the tiny default's writer with :func:`widen` as a
:class:`~qwenkit.model.tiny.checkpoint.Reshape`, the weights in the family's published layout (Qwen3-VL-MoE's fused
experts as Qwen's checkpoints hold them, which vLLM reads). :data:`FAMILIES` lists the families widened.
"""

from __future__ import annotations

from pathlib import Path

from qwenkit.model.families import registry as families
from qwenkit.model.tiny import checkpoint as tiny

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # the families whose widened tiny model vLLM runs on CPU
TEXT = dict(hidden_size=128, intermediate_size=256)  # 4 heads: head dim 32
MROPE = [4, 6, 6]  # sums to head_dim / 2 = 16
LINEAR_HEAD_DIM = 128  # Qwen3.5's linear-attention key and value heads
VISION = dict(hidden_size=64, intermediate_size=128, out_hidden_size=128)  # 2 heads: head dim 32


def widen(config):
    """``config`` (a family's tiny config) at vLLM's CPU shapes, in place; returns it."""
    text = config.text_config
    for k, v in TEXT.items():
        setattr(text, k, v)
    if getattr(text, "head_dim", None) is not None:  # Qwen3-VL names it; Qwen2.5-VL derives it
        text.head_dim = TEXT["hidden_size"] // text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or text.rope_scaling  # 5.x | 4.57
    if rope.get("partial_rotary_factor", 1.0) == 1.0:  # Qwen3.5 rotates a quarter of its head dim 32: as it is
        rope["mrope_section"] = list(MROPE)
    if getattr(text, "linear_key_head_dim", None):  # vLLM's CPU Gated DeltaNet kernel takes head dims of 128
        text.linear_key_head_dim = text.linear_value_head_dim = LINEAR_HEAD_DIM
    for k, v in VISION.items():
        setattr(config.vision_config, k, v)
    if getattr(text, "num_experts", None):  # HF's Qwen3-VL-MoE router always renormalises its top-k; vLLM reads it here
        text.norm_topk_prob = True
    return config


# keys the checkpoint directory (version: bumped when widen changes); vLLM reads the published layout
WIDENED = tiny.Reshape("vllm", 5, widen, published_layout=True)


def ensure_checkpoint(family: str = families.TINY_DEFAULT, seed: int = 0, root: str | Path | None = None) -> Path:
    """Write (once) and return the widened tiny checkpoint of ``family`` (one of :data:`FAMILIES`): the tiny
    default's writer (:func:`qwenkit.model.tiny.checkpoint.ensure_checkpoint`) with :func:`widen` applied to its config."""
    if family not in FAMILIES:
        raise ValueError(f"no vLLM-shaped tiny model of {family!r}; these have one: {', '.join(FAMILIES)}")
    return tiny.ensure_checkpoint(seed=seed, root=root, family=family, reshape=WIDENED)


__all__ = ["FAMILIES", "ensure_checkpoint", "widen"]
