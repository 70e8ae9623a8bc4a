"""The one ``build`` function (the family's subclass, :mod:`qwenkit.model.families.registry`), freezing, and
the parameter counts per part (``parameters.json``)."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from qwenkit.config import DTYPES
from qwenkit.model.families import mtp
from qwenkit.model.families import registry as families
from qwenkit.model.families.chunked import ChunkLossMixin
from qwenkit.model.families.spec import of_run
from qwenkit.model.lora import is_adapter_key
from qwenkit.model.modules import module_path, path_match


def build(model_cfg, loss_cfg=None, device: str | torch.device | None = None) -> ChunkLossMixin:
    """Build the family's chunk-loss subclass (``model.name``, or the checkpoint's ``model_type``)
    from ``model_cfg.path`` (tiny or an HF directory); a name the checkpoint disagrees with is refused.
    A checkpoint of the whole model the family's is part of (a full Omni one) gives the part alone.

    ``init_device=meta`` builds the module tree without storage (weights are loaded into the
    FSDP shards later, see :func:`qwenkit.distributed.weights.load_hf_weights`); otherwise HF's ``from_pretrained`` loads them.
    """
    spec = of_run(model_cfg)
    path, family = spec.path, spec.family
    if problem := family.unavailable():
        raise ValueError(problem)
    cls = family.load("subclass")
    attn = model_cfg.attn_implementation
    if attn == "flash_attention_2" and not any(importlib.util.find_spec(m) for m in ("flash_attn", "torch_npu")):
        # on Ascend, transformers routes flash_attention_2 to torch_npu's kernel
        raise ValueError("model.attn_implementation='flash_attention_2' needs flash-attn (CUDA) or torch_npu (Ascend)")
    dtype = DTYPES[model_cfg.dtype]
    config = spec.hf_config()  # of a whole Omni checkpoint: its thinker's, whose thinker.* weights load
    if model_cfg.init_device == "meta":
        config._attn_implementation = attn
        with torch.device("meta"):
            model = cls(config).to(dtype)
    else:
        model = cls.from_pretrained(path, config=config, dtype=dtype, attn_implementation=attn, local_files_only=True)
        if device is not None:
            model.to(device)
    if model_cfg.mtp.train:  # Qwen3.5's MTP layer (the family's problems refused it for others)
        mtp.attach(model, model_cfg.mtp.layers or family.mtp_layers, model_cfg.mtp.loss_weight)
        if model_cfg.init_device != "meta":  # meta: load_hf_weights fills it with the rest (same names)
            mtp.load_from_checkpoint(model, path)
    model.name_or_path = str(path)
    if loss_cfg is not None:
        model.configure_loss(
            chunk=loss_cfg.chunk,
            chunk_size=loss_cfg.chunk_size,
            loss_type=loss_cfg.loss_type,
            chunk_budget_mb=loss_cfg.chunk_budget_mb,
        )
    freeze(model, [*family.never_trained, *model_cfg.freeze])
    return model


def freeze(model: nn.Module, paths: list[str]) -> None:
    """Stop gradients for each listed module path (e.g. ``model.visual``; ``*`` = one segment, every match)."""
    for path in paths:
        if "*" in path:
            modules = [m for name, m in model.named_modules() if name and path_match(name, path)]
        else:
            try:
                modules = [model.get_submodule(path)]
            except AttributeError:
                modules = []
        if not modules:
            raise ValueError(f"model.freeze: no module {path!r} in {type(model).__name__}")
        for module in modules:
            module.requires_grad_(False)


def parameter_counts(model: nn.Module) -> dict[str, dict[str, int]]:
    """Total, trainable and LoRA-adapter parameter counts per part of the family (tied weights counted once)."""
    family = families.of_model(model)
    out = {name: {"total": 0, "trainable": 0, "adapters": 0} for name, _ in family.parts}
    out["other"] = {"total": 0, "trainable": 0, "adapters": 0}
    for pname, param in model.named_parameters():  # named_parameters dedups tied weights
        part = family.part_of(module_path(pname)) or "other"
        out[part]["total"] += param.numel()
        out[part]["trainable"] += param.numel() if param.requires_grad else 0
        out[part]["adapters"] += param.numel() if is_adapter_key(pname) else 0
    if not out["other"]["total"]:
        del out["other"]
    return out


def format_parameter_counts(counts: dict[str, dict[str, int]]) -> str:
    lines = [f"{'part':<16}{'total':>14}{'trainable':>14}{'adapters':>14}"]
    for name, c in counts.items():
        lines.append(f"{name:<16}{c['total']:>14,}{c['trainable']:>14,}{c.get('adapters', 0):>14,}")
    total, trainable, adapters = (sum(c.get(k, 0) for c in counts.values()) for k in ("total", "trainable", "adapters"))
    lines.append(f"{'all':<16}{total:>14,}{trainable:>14,}{adapters:>14,}")
    return "\n".join(lines)
