"""qwenkit.model.families.build: ``build`` on meta is the module tree ``from_pretrained`` builds (no storage);
``model.name`` disagreeing with the checkpoint is refused; the parameter manifest counts each parameter once,
in the part of the module that holds it, against counts taken from the modules themselves."""

from __future__ import annotations

import pytest

from qwenkit import config as qconfig
from qwenkit.model.families import build as registry


def _shapes(model):
    return {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()}


def test_build_on_meta_is_the_loaded_tree_without_storage(tiny_path):
    loaded = registry.build(qconfig.load(overrides=["model.freeze=[model.visual.merger]"]).model)
    meta = registry.build(qconfig.load(overrides=["model.freeze=[model.visual.merger]", "model.init_device=meta"]).model)
    assert _shapes(meta) == _shapes(loaded)  # names, shapes, dtype (model.dtype) and the freeze
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}
    assert not any(p.requires_grad for p in loaded.model.visual.merger.parameters())


def test_a_model_name_the_checkpoint_disagrees_with_is_refused(tiny_path):
    with pytest.raises(ValueError, match=r"model.name='qwen3_vl' but .*model_type='qwen2_5_vl': use model.name=qwen2_5_vl or auto"):
        registry.build(qconfig.load(overrides=["model.name=qwen3_vl", f"model.path={tiny_path}"]).model)


def test_parameter_counts_count_every_parameter_once_in_its_part(tiny_path):
    model = registry.build(qconfig.load(overrides=["model.freeze=[model.visual]", "model.init_device=meta"]).model)
    counts = registry.parameter_counts(model)
    numel = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731 - dedups tied weights too
    visual = model.model.visual
    assert counts == {
        "vision blocks": {"total": numel(visual) - numel(visual.merger), "trainable": 0, "adapters": 0},
        "merger": {"total": numel(visual.merger), "trainable": 0, "adapters": 0},
        "language model": {"total": numel(model.model.language_model), "trainable": numel(model.model.language_model),
                           "adapters": 0},
        "lm_head": {"total": numel(model.lm_head), "trainable": numel(model.lm_head), "adapters": 0},
    }  # fmt: skip
    table = registry.format_parameter_counts(counts).splitlines()
    assert table[-1].split() == ["all", f"{numel(model):,}", f"{numel(model) - numel(visual):,}", "0"]
    assert [line.split()[0] for line in table[1:-1]] == ["vision", "merger", "language", "lm_head"]
