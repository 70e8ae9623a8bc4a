"""qwenkit.model.family: every entry against the model it describes. Its import paths load HF's class
and qwenkit's subclass of it, the class of its tiny model; its parts, shard and recompute units
name modules of its tiny model (the paths transformers builds); a directory resolves to its entry and
one of another family is refused by name."""

from __future__ import annotations

import json

import pytest
from conftest import EVERY_FAMILY

from qwenkit.model import family as families
from qwenkit.model.chunked import ChunkLossMixin
from qwenkit.model.modules import path_match


@EVERY_FAMILY
def test_the_entry_names_its_classes_and_its_tiny_model_is_of_them(family, make_model):
    entry = families.get(family)
    hf, ours = entry.load("hf_class"), entry.load("subclass")
    assert issubclass(ours, hf) and issubclass(ours, ChunkLossMixin)
    model = make_model()  # from the tiny checkpoint its tiny_config built
    assert type(model) is ours and model.config.model_type == entry.model_type and families.of_model(model) is entry


@EVERY_FAMILY
def test_parts_and_units_name_modules_of_the_familys_model(family, make_model):
    entry, model = families.get(family), make_model()
    modules = [name for name, _ in model.named_modules() if name]
    for unit in (*entry.shard_units, *entry.recompute_units):
        assert any(path_match(name, unit) for name in modules), f"{family}: {unit} matches no module"
    for name, _ in model.named_parameters():
        assert entry.part_of(name) is not None, f"{family}: {name} is in no parameter-count part"


@EVERY_FAMILY
def test_a_directory_resolves_to_its_family_and_another_name_is_refused(family, family_path):
    assert families.resolve("auto", family_path) is families.get(family) is families.of_directory(family_path)
    other = next(name for name in families.FAMILIES if name != family)
    with pytest.raises(ValueError, match=rf"model\.name='{other}' but .*config.json has model_type"):
        families.resolve(other, family_path)


def test_unknown_names_and_model_types_name_the_known_families(tmp_path):
    with pytest.raises(ValueError, match=r"model\.name='qwen9' is not a known family; known: qwen2_5_vl, "):
        families.get("qwen9")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"model_type='llama' is no qwenkit family"):
        families.resolve("auto", tmp_path)
