"""Tiny checkpoints with the shapes vLLM's CPU kernels take: the vLLM tests' models.

vLLM's CPU attention needs a head dim in {32, 64, 80, ..., 512}; the tiny default
(:mod:`qwenkit.model.tiny`) has 16 (64 wide, 4 heads) in its text decoder and its vision tower, and
other tests and recipes depend on its shapes. :func:`ensure_checkpoint` writes the same family's
tiny checkpoint (the same tokenizer, processor, layers and token ids) twice as wide: text 128 wide
with head dim 32 (mRoPE's sections summing to 16), vision 64 wide with head dim 32. Qwen3.5's Gated
DeltaNet on CPU needs bf16 and linear-attention head dims of 128 in vLLM; it is not widened here
(:data:`FAMILIES` lists what is).
"""

from __future__ import annotations

from pathlib import Path

from qwenkit.model import family as families
from qwenkit.model import tiny

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # the families whose widened tiny model vLLM runs on CPU
TEXT = dict(hidden_size=128, intermediate_size=256)  # 4 heads: head dim 32
MROPE = [4, 6, 6]  # sums to head_dim / 2 = 16
VISION = dict(hidden_size=64, intermediate_size=128, out_hidden_size=128)  # 2 heads: head dim 32


def widen(config):
    """``config`` (a family's tiny config) at vLLM's CPU shapes, in place; returns it."""
    text = config.text_config
    for k, v in TEXT.items():
        setattr(text, k, v)
    if getattr(text, "head_dim", None) is not None:  # Qwen3-VL names it; Qwen2.5-VL derives it
        text.head_dim = TEXT["hidden_size"] // text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or text.rope_scaling  # 5.x | 4.57
    rope["mrope_section"] = list(MROPE)
    for k, v in VISION.items():
        setattr(config.vision_config, k, v)
    if getattr(text, "num_experts", None):  # HF's Qwen3-VL-MoE router always renormalises its top-k; vLLM reads it here
        text.norm_topk_prob = True
    return config


# keys the checkpoint directory (version: bumped when widen changes); vLLM reads the published layout
WIDENED = tiny.Reshape("vllm", 4, widen, published_layout=True)


def ensure_checkpoint(family: str = families.TINY_DEFAULT, seed: int = 0, root: str | Path | None = None) -> Path:
    """Write (once) and return the widened tiny checkpoint of ``family`` (one of :data:`FAMILIES`): the tiny
    default's writer (:func:`qwenkit.model.tiny.ensure_checkpoint`) with :func:`widen` applied to its config."""
    if family not in FAMILIES:
        raise ValueError(f"no vLLM-shaped tiny model of {family!r}; these have one: {', '.join(FAMILIES)}")
    return tiny.ensure_checkpoint(seed=seed, root=root, family=family, reshape=WIDENED)


__all__ = ["FAMILIES", "ensure_checkpoint", "widen"]
