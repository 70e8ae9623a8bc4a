"""qwenkit.model.families.registry: the one list of families, and every entry against the model it describes. Its import paths load HF's class
and qwenkit's subclass of it, the class of its tiny model; its parts, shard and recompute units
name modules of its tiny model (the paths transformers builds); a directory resolves to its entry and
one of another family is refused by name."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from pathlib import Path

import pytest
from conftest import EVERY_FAMILY, FAMILIES, tiny_checkpoint, tiny_processor

from qwenkit import cli, launch
from qwenkit import config as qconfig
from qwenkit.engine.run import prespawn
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as families
from qwenkit.model.families.chunked import ChunkLossMixin
from qwenkit.model.families.entry import MIXERS, NOT_EXACT, Mixer
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


ROOT = Path(__file__).resolve().parents[2]


def test_the_registry_is_the_one_list_of_families():
    assert qconfig.MODEL_NAMES == tuple(families.FAMILIES) == FAMILIES
    assert families.TINY_DEFAULT in families.FAMILIES
    for family in families.FAMILIES.values():
        assert set(family.mixers) <= set(MIXERS), family.name


def _spelled(text: str, names) -> list[str]:
    """Each family name in ``text`` as a word of its own (not inside a longer identifier)."""
    return [m.group(0) for n in names for m in re.finditer(rf"(?<![\w]){re.escape(n)}(?![\w])", text)]


def test_no_family_name_is_spelled_outside_the_model_package():
    names = {n for f in families.FAMILIES.values() for n in (f.name, f.model_type)}
    found = {}
    for path in sorted((ROOT / "qwenkit").rglob("*.py")):
        if (ROOT / "qwenkit" / "model") not in path.parents and (hits := _spelled(path.read_text(), names)):
            found[str(path.relative_to(ROOT))] = hits
    assert not found, f"family names outside qwenkit/model/ (ask the entry instead): {found}"
    # the finder: a name as a word, not part of a longer one (a class, an HF module's file name)
    assert _spelled('name == "qwen3_vl" or x.qwen3_vl_moe', ["qwen3_vl"]) == ["qwen3_vl"]
    assert _spelled("modeling_qwen3_vl Qwen3VLConfig", ["qwen3_vl"]) == []


@EVERY_FAMILY
def test_unset_module_patterns_are_the_familys_units(family):
    cfg = qconfig.load(overrides=[f"model.name={family}", "parallel.recompute=auto"])
    assert cfg.parallel.shard_patterns == "auto"
    model = registry.build(dataclasses.replace(cfg.model, init_device="meta"))
    entry = families.of_model(model)
    assert families.units(model, "shard_patterns", "auto") == list(entry.shard_units)
    assert families.units(model, "recompute", "auto") == list(entry.recompute_units)
    assert families.units(model, "recompute", []) == []  # recompute stays off unless asked
    assert prespawn.check_module_paths(cfg) == []  # every unit names modules of the family's tree


def test_params_files_do_not_copy_the_familys_units():
    copies = []
    for path in sorted((ROOT / "params").rglob("*.yaml")):
        raw = qconfig.parse_yaml(path.read_text()) or {}
        model, parallel = raw.get("model") or {}, raw.get("parallel") or {}
        family = families.FAMILIES.get(model.get("name"), families.FAMILIES[families.TINY_DEFAULT])
        if parallel.get("shard_patterns") == list(family.shard_units):
            copies.append(f"{path.relative_to(ROOT)}: parallel.shard_patterns")
        if parallel.get("recompute") == list(family.recompute_units):
            copies.append(f"{path.relative_to(ROOT)}: parallel.recompute (write auto)")
    assert not copies


def test_a_layer_kind_refuses_what_it_cannot_run(monkeypatch):
    """A family with a non-attention sequence mixer (a linear-attention layer) refuses SP, packing
    and an attention implementation its kind does not list; attention alone refuses none of them."""
    monkeypatch.setitem(MIXERS, "linear_attention",
                        Mixer(sequence_parallel=False, packing=False, attn_implementations=("sdpa",)))  # fmt: skip
    hybrid = dataclasses.replace(families.FAMILIES["qwen3_vl"], mixers=("attention", "linear_attention"))
    cfg = qconfig.load(overrides=["parallel.nproc=2", "parallel.sp_size=2", "model.attn_implementation=eager"])
    cfg.data.packing = True
    problems = hybrid.problems(cfg)
    assert [p.split(":")[0] for p in problems] == ["parallel.sp_size=2", "data.packing=true",
                                                   "model.attn_implementation='eager'"]  # fmt: skip
    assert all("linear_attention layers" in p for p in problems)
    assert families.FAMILIES["qwen3_vl"].problems(cfg) == []


def test_fused_ops_that_do_not_fit_are_refused_before_start(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("spawned"))
    code = launch.launch(None, ["model.name=qwen3_vl_moe", "model.fused_ops=[rms_norm, swiglu]",
                                f"train.output_dir={tmp_path}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "model.fused_ops: swiglu do not fit qwen3_vl_moe" in err


@pytest.mark.parametrize(
    "family, ep, pattern",
    [
        ("qwen3_vl", 2, r"qwen3_vl has no routed experts to split \(a dense family\)"),
        ("qwen3_vl_moe", 8, r"parallel\.ep_size=8 must divide the expert count .*num_experts=4"),
        ("qwen3_vl_moe", 2, None),
        ("qwen2_5_vl", 1, None),
    ],
)
def test_expert_parallel_needs_a_moe_checkpoint_whose_experts_it_divides(family, ep, pattern):
    cfg = qconfig.load(overrides=[f"model.name={family}", f"parallel.nproc={ep}", f"parallel.ep_size={ep}"])
    problems = families.problems(cfg, tiny_checkpoint(family))
    if pattern is None:
        assert problems == []
    else:
        assert any(re.search(pattern, p) for p in problems), problems


@pytest.mark.parametrize(
    "family, overrides, key",
    [
        ("qwen2_5_omni", ["data.packing=true"], "data.packing=true"),
        ("qwen2_5_omni", ["parallel.nproc=2", "parallel.sp_size=2"], "parallel.sp_size=2"),
        ("qwen3_omni_moe", ["parallel.nproc=2", "parallel.sp_size=2"], "parallel.sp_size=2"),
    ],
)
@pytest.mark.skipif(bool(families.get("qwen2_5_omni").unavailable()), reason="transformers 4.x has no Omni thinker tree")
def test_what_an_entry_has_not_made_exact_is_refused_before_start(tmp_path, monkeypatch, capsys, family, overrides, key):
    """Every feature in an entry's ``not_exact`` (the Omni thinkers') is one line before any process starts."""
    assert any(NOT_EXACT[f][1](qconfig.load(overrides=overrides)) for f in families.get(family).not_exact)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("spawned"))
    code = launch.launch(None, [f"model.name={family}", *overrides, f"train.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and f"{key}: {family}'s" in err and "is not made exact yet" in err, err
    cfg = qconfig.load(overrides=[f"model.name={family}"])
    assert families.get(family).problems(cfg) == []  # plain SFT runs


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni_moe"])
@pytest.mark.parametrize("overrides", [["lora.r=4"], ["train.objective=dpo"], ["train.objective=grpo"],
                                       ["parallel.ep_size=2"]], ids=["lora", "dpo", "grpo", "ep"])  # fmt: skip
@pytest.mark.skipif(bool(families.get("qwen2_5_omni").unavailable()), reason="transformers 4.x has no Omni thinker tree")
def test_the_omni_thinkers_start_lora_dpo_grpo_and_ep_where_they_have_experts(tmp_path, monkeypatch, capsys, family, overrides):
    """What the Omni entries no longer refuse reaches the spawn (from a whole Omni checkpoint, whose thinker's
    expert count the EP check reads); EP on the dense thinker is the dense families' one-line refusal."""
    spawned = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: spawned.append(1) or 0)
    whole = tiny_checkpoint(family, whole=True)
    code = launch.launch(None, [f"model.path={whole}", "parallel.nproc=2", "parallel.allow_oversubscribe=true",
                                *overrides, f"train.output_dir={tmp_path}"])  # fmt: skip
    err = capsys.readouterr().err
    if overrides == ["parallel.ep_size=2"] and not families.get(family).experts:
        assert code == 2 and not spawned and f"{family} has no routed experts to split" in err, err
    else:
        assert code == 0 and spawned, err


@pytest.mark.parametrize("key", ["grpo.rollout_engine", "train.eval_engine"])
def test_a_family_vllm_cannot_run_is_refused_before_start_and_by_qwenkit_eval(key):
    """Qwen4-Exp's entry says why vLLM cannot run it (vLLM 0.32 has no such model): one line naming the key before
    any process starts, and ``qwenkit eval --engine vllm`` stops before starting an engine (``spec_of``). The MoE
    families vLLM runs are not refused (their pushes are exact: tests/engine/generation/test_vllm_engine.py)."""
    from qwenkit.engine.generation import vllm_engine

    cfg = qconfig.load(overrides=["model.name=qwen4_exp"])
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, "vllm")  # (the config check wants vLLM installed for this)
    refused = families.get("qwen4_exp")
    assert refused.problems(cfg) == [f"{key}=vllm: {refused.vllm_refusal}; use the hf engine"]
    assert "no qwen4_exp model" in refused.vllm_refusal
    for family in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5_moe"):
        assert families.get(family).problems(cfg) == [], family
    with pytest.raises(ValueError, match=r"^vLLM cannot run qwen4_exp: .*; use the hf engine$"):
        vllm_engine.spec_of(cfg, tiny_processor("qwen4_exp"), str(tiny_checkpoint("qwen4_exp")))


@pytest.mark.skipif(bool(families.get("qwen3_5").unavailable()), reason="transformers 4.x has no Qwen3.5")
def test_vllm_on_cpu_runs_qwen3_5_in_bfloat16_only():
    from qwenkit.engine.generation import vllm_engine
    from qwenkit.model.tiny import vllm as tiny_vllm

    cfg = qconfig.load(overrides=["model.name=qwen3_5"])
    args = (tiny_processor("qwen3_5"), str(tiny_vllm.ensure_checkpoint("qwen3_5")))  # linear-attention heads of 128
    with pytest.raises(ValueError, match=r"^the vllm engine: vLLM's CPU backend runs qwen3_5's Gated DeltaNet layers "
                                         r"in bfloat16 only, and model.dtype=float32; set model.dtype=bfloat16, or use the "
                                         r"hf engine$"):  # fmt: skip
        vllm_engine.spec_of(cfg, *args)
    cfg.model.dtype = "bfloat16"
    assert vllm_engine.spec_of(cfg, *args).dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"linear-attention key and value head dims of 128 only, and .* has 16 and 16"):
        vllm_engine.spec_of(cfg, args[0], str(tiny_checkpoint("qwen3_5")))  # the tiny default's 16


# the families tests/engine/generation/test_vllm_engine.py starts vLLM with (ENGINE_FAMILIES and its isolated ones)
VLLM_TRIED = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "qwen2_5_omni")


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_a_family_never_tried_in_vllm_is_refused_for_it(family):
    """A family the vLLM tests never start an engine with has a refusal on its entry (one line before start,
    not an engine failing mid-run): a new family must be tried in vLLM or say why not."""
    assert family in VLLM_TRIED or families.get(family).vllm_refusal, family


@EVERY_FAMILY
def test_a_transformers_without_the_family_is_refused_in_one_line(family, tmp_path, monkeypatch, capsys):
    """As on 4.57 (Qwen3.5, the Omni thinkers) or 5.x before 5.23 (Qwen4-Exp): the family's module is missing; the
    launcher refuses before writing the tiny checkpoint, and no rank starts."""
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun must not start"))
    entry = families.get(family)
    module = f"transformers.models.{entry.hf_module or entry.model_type}"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m.startswith(module) else find_spec(m, *a))
    out = tmp_path / "run"
    assert cli.main(["train", f"model.name={family}", f"train.output_dir={out}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if module in line]
    assert len(lines) == 1 and f"model.name={family} needs transformers" in lines[0]
    assert not out.exists()
