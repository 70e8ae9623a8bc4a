"""Tiny Qwen3.5 checkpoints with the linear-attention heads vLLM's CPU kernel takes: the vLLM tests' Qwen3.5 models.

Every tiny family's attention runs on vLLM's CPU backend as it is (head dim 32, :mod:`qwenkit.model.families.tiny_configs`),
but vLLM's CPU Gated DeltaNet takes linear-attention key and value head dims of 128 only, and runs bf16 only: the
tiny Qwen3.5 keeps 16 (its linear layers at 128 would double every Qwen3.5 test's compute), and a run of it on vLLM
on CPU is refused before any process starts (:func:`qwenkit.model.families.entry.vllm_cpu_problem`).
:func:`ensure_checkpoint` writes the same family's tiny checkpoint (the same tokenizer, processor, layers and
token ids) with :func:`widen` as a :class:`~qwenkit.model.tiny.checkpoint.Reshape`. :data:`FAMILIES` lists the
families widened.
"""

from __future__ import annotations

from pathlib import Path

from qwenkit.model.tiny import checkpoint as tiny

FAMILIES = ("qwen3_5", "qwen3_5_moe")  # the families whose tiny model vLLM's CPU backend runs only widened
LINEAR_HEAD_DIM = 128  # Qwen3.5's linear-attention key and value heads, as vLLM's CPU kernel takes them


def widen(config):
    """``config`` (a Qwen3.5 family's tiny config) with vLLM's CPU linear-attention head dims, in place; returns it."""
    text = config.text_config
    text.linear_key_head_dim = text.linear_value_head_dim = LINEAR_HEAD_DIM
    return config


# keys the checkpoint directory (version: bumped when widen changes)
WIDENED = tiny.Reshape("vllm", 6, widen)


def ensure_checkpoint(family: str = "qwen3_5", seed: int = 0, root: str | Path | None = None) -> Path:
    """Write (once) and return the widened tiny checkpoint of ``family`` (one of :data:`FAMILIES`): the tiny
    default's writer (:func:`qwenkit.model.tiny.checkpoint.ensure_checkpoint`) with :func:`widen` applied to its config."""
    if family not in FAMILIES:
        raise ValueError(f"no vLLM-widened tiny model of {family!r}; these have one: {', '.join(FAMILIES)} (the other "
                         "families' tiny models run on vLLM as they are)")  # fmt: skip
    return tiny.ensure_checkpoint(seed=seed, root=root, family=family, reshape=WIDENED)


__all__ = ["FAMILIES", "ensure_checkpoint", "widen"]
