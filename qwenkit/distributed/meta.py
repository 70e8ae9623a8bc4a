"""Parameters as structure: building a module tree without weight storage, and finding tied weights.

Three places need a model whose parameters are placeholders on the meta device but whose
buffers are real: meta-device init (:func:`qwenkit.distributed.fsdp.materialize` takes the
non-persistent buffers, rotary ``inv_freq``, from such a twin), the one-process export
(:func:`qwenkit.engine.checkpoints.export.load_hf` fills it from a DCP checkpoint) and the generation copy
(:func:`qwenkit.engine.generation.placement.unsharded_copy` fills it with gathered full tensors). None of
them initialises weights it would overwrite. :func:`build_on_meta` is that one construction.

Tied weights (Qwen2.5-VL-3B's ``lm_head.weight`` is ``embed_tokens.weight``) matter to sharding
(a tied weight must live in one FSDP group), to loading (a tied checkpoint stores one of the
names) and to export (the checkpoint holds one name of the pair): :func:`tied_groups` finds them.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def parameters_on_meta():
    """Inside: modules register their parameters on meta; buffers are computed for real (on the CPU)."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_on_meta(cls: type[nn.Module], config: Any) -> nn.Module:
    """``cls(config)`` with every parameter on meta (no storage, no init) and real CPU buffers."""
    with parameters_on_meta():
        return cls(config)


def set_buffer(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Replace the buffer at dotted ``name`` by ``tensor`` (keeps its persistence flag)."""
    module_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(module_name) if module_name else model
    owner._buffers[leaf] = tensor


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Parameter names that share one tensor, a list per tensor with two or more names.

    Names are ``named_parameters`` names (wrapper segments such as checkpoint_wrapper's
    included; :func:`qwenkit.model.modules.module_path` removes them).
    """
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]
