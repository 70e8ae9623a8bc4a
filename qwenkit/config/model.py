"""``model``: the checkpoint, its family and dtype, frozen modules, the fused ops and their backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from qwenkit.config.libraries import FUSED_LIBRARIES, PIP_NAMES, installed
from qwenkit.model.families.registry import FAMILIES

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # Dtype -> torch
# The allowed names: the schema owns them, and the code that implements them (qwenkit.patches)
# imports them from here, so config stays a leaf.
FUSED_OPS = ("rms_norm", "vision_rope", "swiglu")  # model.fused_ops; qwenkit.patches implements them
FUSED_BACKENDS = ("auto", "npu", "cuda")  # model.fused_backend
# model.name: the families' one list is their registry (a light module the leaf may read, docs/ARCHITECTURE.md)
MODEL_NAMES = tuple(FAMILIES)


@dataclass
class MTPConfig:
    # Qwen3.5's multi-token-prediction layer (the checkpoint's mtp.*; qwenkit.model.families.mtp): trained
    # beside the model (MindSpeed-MM's mtp_num_layers / mtp_loss_scaling_factor); off: exported unchanged
    train: bool = False
    loss_weight: float = 0.1  # its loss's weight in the training loss (mtp_loss_scaling_factor)
    layers: int = 0  # the MTP depths trained, from the first; 0: all the checkpoint has (mtp_num_hidden_layers)


@dataclass
class ModelConfig:
    # the model family (qwenkit.model.families.registry.FAMILIES); auto: the checkpoint's config.json model_type
    # (path=tiny: qwenkit.model.families.registry.TINY_DEFAULT). A name that disagrees with the checkpoint is refused before start
    name: Literal[("auto", *MODEL_NAMES)] = "auto"
    path: str = "tiny"  # "tiny" (embedded default) or a Hugging Face checkpoint directory
    dtype: Dtype = "float32"  # dtype the weights are loaded in
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    freeze: list[str] = field(default_factory=list)  # module paths, e.g. ["model.visual"]
    fused_ops: Literal["auto", "off"] | list[str] = "auto"  # or a subset of FUSED_OPS
    # auto: NPU tensors run torch_npu, CUDA tensors Liger (when installed); npu | cuda: that route only
    fused_backend: Literal[FUSED_BACKENDS] = "auto"
    init_device: Literal["cpu", "meta"] = "cpu"  # meta: build empty, shard, then load weights into shards
    tie_word_embeddings: bool = False  # only for path=tiny (HF checkpoints carry their own)
    # start from another run: its output_dir (newest checkpoint) or a step-N dir; the launcher
    # exports it as <run>/hf-step-N and sets model.path there (qwenkit/engine/checkpoints/init_from.py)
    init_from: str | None = None
    init_recipe: str | None = None  # the params file that trains model.init_from when it has no checkpoint yet
    mtp: MTPConfig = field(default_factory=MTPConfig)


def fused_ops_problems(ops: Any) -> list[str]:
    """What is wrong with a ``model.fused_ops`` value (``auto``, ``off`` or a list of FUSED_OPS)."""
    if ops in ("auto", "off"):
        return []
    if isinstance(ops, str) or not isinstance(ops, (list, tuple)) or not all(isinstance(o, str) for o in ops):
        return [f"fused ops must be 'auto', 'off' or a list of {', '.join(FUSED_OPS)}; got {ops!r}"]
    return [f"unknown fused op {op!r}; allowed: {', '.join(FUSED_OPS)}" for op in ops if op not in FUSED_OPS]


def fused_backend_problem(backend: str) -> str | None:
    """Why ``model.fused_backend`` cannot run here (not a backend, or its library is missing), or None."""
    if backend not in FUSED_BACKENDS:
        return f"fused_backend must be one of {', '.join(FUSED_BACKENDS)}, got {backend!r}"
    library = FUSED_LIBRARIES.get(backend)
    if library is None or installed(library):
        return None
    return (
        f"fused_backend={backend!r} needs {PIP_NAMES[library]}, which is not installed: "
        f"pip install 'qwenkit[{backend}]', or use auto (each tensor's device picks its kernels)"
    )
