"""qwenkit.model.families.spec: a checkpoint's family resolved once, with its config.json, for every way a run names it."""

from __future__ import annotations

import json

import pytest
from conftest import EVERY_FAMILY, tiny_checkpoint

from qwenkit import config as qconfig
from qwenkit.model.families import registry as families
from qwenkit.model.families import spec as model_spec


@EVERY_FAMILY
def test_a_run_resolves_its_family_and_config_once(family, family_path):
    cfg = qconfig.load(overrides=[f"model.name={family}"])  # model.path=tiny: the family's tiny checkpoint
    spec = model_spec.of_run(cfg.model)
    assert spec.family is families.get(family) and spec.path == family_path
    assert spec.config == json.loads((family_path / "config.json").read_text())
    assert model_spec.resolve("auto", family_path) == spec  # auto: the checkpoint's model_type


def test_another_familys_checkpoint_is_refused():
    path = tiny_checkpoint("qwen2_5_vl")
    with pytest.raises(ValueError, match=r"model\.name='qwen3_vl' but .*config.json has model_type"):
        model_spec.resolve("qwen3_vl", path)


def test_an_adapter_export_has_its_base_models_family(tmp_path):
    base = tiny_checkpoint("qwen3_vl")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    spec = model_spec.of_export(tmp_path)
    assert spec.family is families.get("qwen3_vl") and spec.path == base
    assert model_spec.of_export(base).family is families.get("qwen3_vl")  # a full export: its own config.json
