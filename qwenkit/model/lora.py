"""LoRA adapters from peft, added to the model before ``fully_shard``.

With ``lora.r > 0`` :func:`apply` asks peft (``inject_adapter_in_model``) to wrap the target
linears in place, so the model stays qwenkit's class and FSDP2 shards base weights and adapters
together, unit by unit (a decoder layer's frozen ``base_layer`` weights and its trainable
``lora_A``/``lora_B`` are gathered by one all-gather). peft freezes everything but the adapters;
``lora.modules_to_save`` are then trained fully (plain ``requires_grad``, no peft wrapper: no
second copy of the module). State-dict keys are peft's: ``...q_proj.base_layer.weight``,
``...q_proj.lora_A.default.weight``; :func:`base_key` maps them back to the checkpoint's.

Targets are resolved here to exact module paths (what peft is given): ``all-linear`` is every
``nn.Linear`` of the language model (and of the vision blocks with ``lora.vision``), never
``lm_head``, whose forward computes the chunked loss. A name (``q_proj``) matches that last path
segment, a dotted pattern (``model.language_model.layers.*.mlp.down_proj``) the whole path with
``*`` one segment; one that matches no linear is an error naming it (:func:`problems`, which
the launcher runs on the module tree built on meta before any rank starts).

Initialisation is peft's (``lora_A`` Kaiming-uniform with a = sqrt(5), ``lora_B`` zero, so the
model starts as the base), drawn from a generator seeded with ``train.seed``
(:func:`initial_adapters`): the same adapters whether the model is built on the CPU or on meta
(then written into the shards after the base weights are read), on any number of ranks.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re

import torch
from torch import nn

from qwenkit.model.families import registry as families
from qwenkit.model.modules import path_match

ADAPTER = "default"  # peft's adapter name, a segment of every adapter key


# ---------------------------------------------------------------------------------------------
# Targets


def _target_match(name: str, entry: str) -> bool:
    """A ``lora.target_modules`` entry without dots names the last segment (``q_proj``); with
    dots, the whole path (the config's one module-path rule)."""
    if "." not in entry:
        return fnmatch.fnmatchcase(name.rpartition(".")[2], entry)
    return path_match(name, entry)


def _linears(model: nn.Module, lora_cfg) -> list[str]:
    """The ``nn.Linear`` paths of the family's towers (its entry's ``lora_towers``): the language
    model, the vision blocks with ``lora.vision``, and Qwen3.5's MTP layer where ``model.mtp.train``
    attached it (its ``fc``, attention and MLP: the MTP loss trains their adapters). A MoE's fused experts and its router are
    parameters, not linears: ``all-linear`` adapts attention (and any dense MLP) there; the
    router, a linear in transformers 4.57, is left out (the entry's ``lora_exclude``)."""
    family = families.of_model(model)
    towers = ("text", "vision") if lora_cfg.vision else ("text",)
    if getattr(model, "mtp", None) is not None and "mtp" in family.lora_towers:
        towers += ("mtp",)
    return [
        n for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and any(family.in_tower(n, t) for t in towers) and not family.lora_excluded(n)
    ]  # fmt: skip


def target_problems(model: nn.Module, lora_cfg) -> tuple[list[str], list[str]]:
    """``(module paths to adapt, problems)``: each target entry must match a linear of the towers."""
    linears = _linears(model, lora_cfg)
    if lora_cfg.target_modules == "all-linear":
        return linears, []
    where = "the language model" + (" or the vision blocks" if lora_cfg.vision else " (lora.vision=false)")
    found, problems = set(), []
    for entry in lora_cfg.target_modules:
        hits = [n for n in linears if _target_match(n, entry)]
        if not hits:
            problems.append(f"lora.target_modules: {entry!r} matches no linear layer of {where}")
        found.update(hits)
    return [n for n in linears if n in found], problems


def expert_parameters(model: nn.Module, lora_cfg) -> list[str]:
    """With ``lora.target_experts``: the paths of the routed experts' fused weights (each experts
    module of the family entry's ``experts``, its 3-D parameters: ``gate_up_proj`` ``[E, 2I, H]``,
    ``down_proj`` ``[E, H, I]``), which peft adapts as ``target_parameters``: per expert a rank-``r``
    pair, all experts' pairs stacked in one ``lora_A`` ``[r E, in]`` and one ``lora_B`` ``[out, r E]``."""
    if not lora_cfg.target_experts:
        return []
    patterns = families.of_model(model).experts
    return [
        f"{base_key(n)}.{p}" for n, m in model.named_modules() if any(path_match(base_key(n), pat) for pat in patterns)
        for p, param in m.named_parameters(recurse=False) if param.dim() == 3
    ]  # fmt: skip


def problems(model: nn.Module, lora_cfg) -> list[str]:
    """``lora.target_modules`` entries and ``lora.modules_to_save`` paths that name nothing in
    ``model``, ``lora.target_experts`` on a model without routed experts (the launcher runs this on
    the module tree built on meta, before any rank starts)."""
    if lora_cfg.r == 0:
        return []
    found = target_problems(model, lora_cfg)[1]
    if lora_cfg.target_experts and not expert_parameters(model, lora_cfg):
        found.append(f"lora.target_experts=true: {families.of_model(model).name} has no routed experts to adapt")
    names = {n for n, _ in model.named_modules() if n}
    return found + [
        f"lora.modules_to_save: no module {path!r} in {type(model).__name__}"
        for path in lora_cfg.modules_to_save
        if path not in names
    ]


# ---------------------------------------------------------------------------------------------
# Adding the adapters


def peft_config(lora_cfg, model: nn.Module, modules_to_save: bool = False):
    """peft's ``LoraConfig`` for ``model``: the exact module paths of :func:`target_problems` and the
    expert weights of :func:`expert_parameters` (``modules_to_save`` only for a PeftModel)."""
    from peft import LoraConfig

    targets, problems = target_problems(model, lora_cfg)
    if problems:
        raise ValueError("; ".join(problems))
    return LoraConfig(
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout, target_modules=targets,
        target_parameters=expert_parameters(model, lora_cfg) or None,
        use_dora=lora_cfg.use_dora, use_rslora=lora_cfg.use_rslora, bias="none",
        modules_to_save=(list(lora_cfg.modules_to_save) or None) if modules_to_save else None,
    )  # fmt: skip


def apply(model: nn.Module, lora_cfg, seed: int) -> list[str]:
    """Add the adapters in place (before recompute wrappers and ``fully_shard``); returns the targets.

    On a meta model the adapters stay on meta; :func:`initial_adapters` gives their values once
    the model has storage (the trainer writes them after the base weights).
    """
    from peft import inject_adapter_in_model

    config = peft_config(lora_cfg, model)
    targets = [*config.target_modules, *(config.target_parameters or ())]
    meta = any(p.is_meta for p in model.parameters())
    inject_adapter_in_model(config, model, low_cpu_mem_usage=meta)
    for path in lora_cfg.modules_to_save:
        model.get_submodule(path).requires_grad_(True)
    model.qwenkit_lora = lora_cfg  # export, generation and checkpoints ask has_adapters()
    if not meta:
        init = initial_adapters(model, seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in init:
                    param.copy_(init[name])
    return targets


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model inside the block: every LoRA layer runs its ``base_layer`` alone (DPO's reference).

    peft's own switch (``enable_adapters(False)``) also sets ``requires_grad=False`` on the
    adapters and back, which would change what the optimizer and FSDP2 see; only the flag its
    layers read in ``forward`` is flipped here, and restored.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m, flag in zip(layers, before):
            m._disable_adapters = flag


def parameter_adapters(module: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """``(the module peft wrapped, {parameter name: its adapter})`` of a module whose parameters peft
    adapts (``target_parameters``: one ``ParamWrapper`` per parameter, each wrapping the next);
    ``(module, {})`` for any other module."""
    adapters = {}
    while hasattr(module, "parameter_name") and hasattr(module, "base_layer"):  # peft's ParamWrapper
        adapters[module.parameter_name] = module
        module = module.base_layer
    return module, adapters


def has_adapters(model: nn.Module) -> bool:
    return getattr(model, "qwenkit_lora", None) is not None


def is_adapter_key(key: str) -> bool:
    return f".{ADAPTER}." in key and any(f".{k}." in key for k in ("lora_A", "lora_B", "lora_magnitude_vector"))


def base_key(key: str) -> str:
    """A model key of the adapted model in the base model's layout (every ``.base_layer`` dropped: an experts
    module adapted in both fused weights is two wrappers, ``experts.base_layer.base_layer.gate_up_proj``)."""
    return re.sub(r"\.base_layer(?=\.)", "", key)


def initial_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full initial values of every ``lora_A``/``lora_B`` weight, keyed like the model's state dict.

    peft's default init (``reset_lora_parameters`` with ``init_lora_weights=True``): A Kaiming
    uniform (a = sqrt(5)), B zero; drawn in module order from one generator seeded with ``seed``.
    DoRA's magnitude vector is not here: peft computes it from the base weight (CPU init only).
    """
    from peft.tuners.lora import LoraLayer

    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
            continue
        name = name.replace("._checkpoint_wrapped_module", "")
        a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
        a_init = torch.empty(a.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a_init, a=math.sqrt(5), generator=gen)
        out[f"{name}.lora_A.{ADAPTER}.weight"] = a_init.to(a.dtype)
        out[f"{name}.lora_B.{ADAPTER}.weight"] = torch.zeros(b.shape, dtype=b.dtype)
    return out


def merge_in_place(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the base module back (peft's merge).

    Every adapter merges before any wrapper is taken out: an experts module adapted in both fused
    weights is two wrappers, one inside the other, and the outer one's base is the inner wrapper.
    """
    from peft.tuners.lora import LoraLayer

    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]
    for _, module in layers:
        module.merge(adapter_names=[ADAPTER])
    for name, module in layers:
        if ".base_layer" in f".{name}":  # inside another wrapper: goes with it
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    return model
