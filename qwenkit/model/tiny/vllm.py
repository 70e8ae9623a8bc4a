"""The tiny checkpoints vLLM's CPU backend takes only changed: the vLLM tests' Qwen3.5s and Qwen3-VL-MoE.

Every tiny family's attention runs on vLLM's CPU backend as it is (heads of 32, :mod:`qwenkit.model.families.tiny_configs`),
so the embedded default runs with vLLM unchanged. Two things it does not take:

- Qwen3.5's linear attention: vLLM's CPU Gated DeltaNet takes key and value head dims of 128 only (16 fails
  inside the engine with ``expect head_dim to be multiples of 32``, 32 with ``Unexpected head dim size``), and
  runs bf16 only. The tiny Qwen3.5s keep 16 (at 128 every Qwen3.5 test would take twice the compute), so a run
  of them on vLLM on CPU is refused before any process starts (:func:`qwenkit.model.families.vllm_limits.vllm_cpu_problem`);
  :func:`widen` writes them at 128.
- Qwen3-VL-MoE's fused experts in the layout of Qwen's published checkpoints (which vLLM reads), not the one
  transformers 5.x writes; the kit's own sharded loader (:func:`qwenkit.distributed.weights.load_hf_weights`)
  reads the tensors as the model holds them, so the tiny default keeps transformers' layout.

:func:`ensure_checkpoint` writes the same family's tiny checkpoint (the same tokenizer, processor, layers and
token ids) with :data:`WIDENED` as its :class:`~qwenkit.model.tiny.checkpoint.Reshape`. :data:`FAMILIES` lists them.
"""

from __future__ import annotations

from pathlib import Path

from qwenkit.model.tiny import checkpoint as tiny

FAMILIES = ("qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")  # the families whose tiny model vLLM's CPU backend takes only changed
LINEAR_HEAD_DIM = 128  # Qwen3.5's linear-attention key and value heads, as vLLM's CPU kernel takes them


def widen(config):
    """``config`` (a family's tiny config) with vLLM's CPU linear-attention head dims where it has linear attention,
    in place; returns it."""
    text = config.text_config
    if getattr(text, "linear_key_head_dim", None):
        text.linear_key_head_dim = text.linear_value_head_dim = LINEAR_HEAD_DIM
    return config


# keys the checkpoint directory (version: bumped when widen changes); vLLM reads the published layout
WIDENED = tiny.Reshape("vllm", 6, widen, published_layout=True)


def ensure_checkpoint(family: str = "qwen3_5", seed: int = 0, root: str | Path | None = None) -> Path:
    """Write (once) and return the vLLM copy of ``family``'s tiny checkpoint (one of :data:`FAMILIES`): the tiny
    default's writer (:func:`qwenkit.model.tiny.checkpoint.ensure_checkpoint`) with :data:`WIDENED`."""
    if family not in FAMILIES:
        raise ValueError(f"no vLLM-widened tiny model of {family!r}; these have one: {', '.join(FAMILIES)} (the other "
                         "families' tiny models run on vLLM as they are)")  # fmt: skip
    return tiny.ensure_checkpoint(seed=seed, root=root, family=family, reshape=WIDENED)


__all__ = ["FAMILIES", "ensure_checkpoint", "widen"]
