"""The tensors a weight push sends (:meth:`qwenkit.engine.generation.vllm_engine.VllmEngine.push`, and to a server
:meth:`qwenkit.engine.generation.vllm_client.ServedEngine.push`): each parameter
of the training model under its HF name, gathered whole, its LoRA adapter merged in.

- **Gathered one at a time** (``full_tensor()``, collective for a sharded model: every rank iterates alike): an
  FSDP2 shard, and under expert parallelism an expert weight on the ``(efsdp, ep)`` mesh
  (:mod:`qwenkit.distributed.expert`), come out whole; a LoRA layer's base weight is held only until its
  adapter's two factors have come (an adapted experts module's two fused weights come before their factors).
- **LoRA merged** as peft merges it, the adapters staying unmerged in the trained model: a linear's
  ``W + scaling * B @ A`` (peft's ``Linear.get_delta_weight``); with ``lora.target_experts`` a fused expert
  weight ``[E, out, in]`` (peft's ``ParamWrapper``: one rank-``r`` pair per expert, stacked in ``lora_A``
  ``[r E, in]`` and ``lora_B`` ``[out, r E]``) gets each expert's ``scaling * B_e @ A_e`` (peft's
  ``ParamWrapper.get_delta_weight``). The adapters' own tensors are not sent.

The reference for both is peft's merge (:func:`qwenkit.model.lora.merge_in_place`): vLLM's replies after a push
of an adapted model equal the kit's replies from the merged copy (``tests/engine/generation/test_vllm_engine.py``).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from qwenkit.engine.generation.vllm_omni import whole_name
from qwenkit.model import lora
from qwenkit.model.families import registry as families
from qwenkit.model.modules import module_path

ADAPTER_PART = re.compile(rf"^(.*)\.lora_([AB])\.{lora.ADAPTER}\.weight$")  # a LoRA layer's factor (peft's names)


def checkpoint_tensors(model: nn.Module, dtype: torch.dtype):
    """:func:`hf_tensors` as the checkpoint holds them (what vLLM's ``reload_weights`` reads): each in the family's
    published layout (fused MoE experts: :meth:`qwenkit.model.families.registry.Family.checkpoint_tensor`), in ``dtype``.
    Collective as :func:`hf_tensors`: the colocated engine's push and a server's (its sender, rank 0) iterate it."""
    family = families.of_model(model)
    for name, full in hf_tensors(model):  # an Omni thinker's under the whole checkpoint's names (vllm_omni.whole_name)
        yield whole_name(model, family, name, full), family.checkpoint_tensor(name, full).to(dtype).contiguous()


def hf_tensors(model: nn.Module):
    """``(HF name, full tensor)`` of each parameter of ``model`` (module docstring)."""
    bases = lora_bases(model)  # a LoRA layer's base parameter -> the layer's path
    base_of = {layer: base for base, layer in bases.items()}
    held: dict[str, dict[str, torch.Tensor]] = {}  # a LoRA layer's path -> its base, A and B gathered so far
    for name, p in model.named_parameters():
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
        found = ADAPTER_PART.match(name)
        if name in bases:
            layer, part = bases[name], "base"
        elif found is not None and found.group(1) in base_of:
            layer, part = found.groups()
        else:
            yield lora.base_key(module_path(name)), full  # a LoRA layer's bias too: its base layer's
            continue
        parts = held.setdefault(layer, {})
        parts[part] = full
        if len(parts) == 3:
            yield lora.base_key(module_path(base_of[layer])), merged(model.get_submodule(layer), parts)
            del held[layer]


def lora_bases(model: nn.Module) -> dict[str, str]:
    """``{base parameter's name: its LoRA layer's path}`` of every LoRA layer of ``model``: a linear's
    ``<layer>.base_layer.weight``; a parameter's wrapper (``ParamWrapper``, ``lora.target_experts``) adapts
    ``parameter_name`` of the module it wraps, itself maybe another wrapper (one per adapted fused weight)."""
    if not lora.has_adapters(model):
        return {}
    from peft.tuners.lora import LoraLayer

    found = {}
    for path, module in model.named_modules():
        if not isinstance(module, LoraLayer) or lora.ADAPTER not in module.lora_A:
            continue
        if hasattr(module, "parameter_name"):
            inner, at = module.base_layer, f"{path}.base_layer"
            while hasattr(inner, "parameter_name") and hasattr(inner, "base_layer"):
                inner, at = inner.base_layer, f"{at}.base_layer"
            found[f"{at}.{module.parameter_name}"] = path
        else:
            found[f"{path}.base_layer.weight"] = path
    return found


def merged(layer: nn.Module, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The base weight of the LoRA ``layer`` plus its adapter's delta, from the gathered ``parts`` (``base``,
    ``A``, ``B``), as peft's ``get_delta_weight`` computes it, in float32, cast back to the base's dtype."""
    weight, a, b = parts["base"], parts["A"].float(), parts["B"].float()
    scaling = layer.scaling[lora.ADAPTER]
    if not hasattr(layer, "parameter_name"):  # a linear: [out, r] @ [r, in]
        return weight + (scaling * (b @ a)).to(weight.dtype)
    experts = layer.num_experts
    a = a.reshape(experts, -1, a.shape[-1])  # [E, r, in]
    b = b.reshape(b.shape[0], -1, experts)  # [out, r, E]
    # peft: the experts' weights stored [E, in, out], or [E, out, in] (_did_swap_in_out_features, Qwen's)
    how = "o r e, e r i -> e o i" if layer._did_swap_in_out_features else "o r e, e r i -> e i o"
    return weight + (scaling * torch.einsum(how, b, a)).to(weight.dtype)


__all__ = ["checkpoint_tensors", "hf_tensors", "lora_bases", "merged"]
