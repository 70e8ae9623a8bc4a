"""qwenkit.engine.run.build: the model a run trains is the family's subclass with exactly the fused ops that
fit the family (the patch report), computing on CPU bit for bit what the unpatched model computes."""

from __future__ import annotations

import pytest
import torch
from conftest import EVERY_FAMILY

from qwenkit import config as qconfig
from qwenkit import patches
from qwenkit.bench.step import loss_and_grads
from qwenkit.engine.run.build import fused_model
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as families


def _cfg(family, *overrides):
    return qconfig.load(overrides=[f"model.name={family}", "loss.chunk=true", *overrides])


def _patched(model) -> set[str]:
    return {name for name, m in model.named_modules() if "_qwenkit_patch" in m.__dict__}


@EVERY_FAMILY
def test_the_run_model_is_the_family_subclass_with_the_ops_that_fit(family, batch_factory):
    cfg, entry = _cfg(family), families.get(family)
    model = fused_model(cfg)
    assert type(model) is entry.load("subclass")
    reference = registry.build(cfg.model, cfg.loss)  # patched by hand with what the entry says fits
    patches.apply(reference, backend=cfg.model.fused_backend, ops=cfg.model.fused_ops, applicable=entry.fused_ops)
    assert _patched(model) == _patched(reference) != set()
    plain = registry.build(cfg.model, cfg.loss)
    model.load_state_dict(plain.state_dict())
    batch = batch_factory()
    (la, ga), (lb, gb) = loss_and_grads(plain, batch), loss_and_grads(model, batch)
    assert torch.equal(la, lb) and ga.keys() == gb.keys()
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


@pytest.mark.parametrize("family", ["qwen2_5_vl"], indirect=True)
def test_fused_ops_off_patches_nothing(family):
    assert _patched(fused_model(_cfg(family, "model.fused_ops=off"))) == set()
