"""Config loading: every problem is reported with its key path before any model is built."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from conftest import tiny_checkpoint

from qwenkit import config
from qwenkit.config import ConfigError
from qwenkit.model import family as families


def test_defaults_are_valid():
    cfg = config.load()
    assert cfg.loss.chunk and cfg.model.path == "tiny"


def test_yaml_and_dotted_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("train:\n  steps: 5\nloss:\n  chunk_size: 256\n")
    cfg = config.load(p, ["train.steps=7", "model.freeze=[model.visual]", "loss.chunk_size=auto"])
    assert cfg.train.steps == 7
    assert cfg.model.freeze == ["model.visual"]
    assert cfg.loss.chunk_size == "auto"


def test_unknown_key_suggests_the_near_one():
    with pytest.raises(ConfigError, match=r"unknown key 'train\.stesp'; did you mean 'train\.steps'"):
        config.load(overrides=["train.stesp=3"])


def test_unknown_section():
    with pytest.raises(ConfigError, match=r"unknown key 'trian'.*did you mean 'train'"):
        config.load(overrides={"trian": {"steps": 3}})


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("train.steps=many", r"train\.steps: got 'many', expected int"),
        ("train.lr=true", r"train\.lr: got True, expected float"),
        ("loss.chunk_size=big", r"loss\.chunk_size: got 'big', expected int or one of 'auto'"),
        ("model.dtype=fp8", r"model\.dtype: got 'fp8', expected one of 'float32'"),
        ("model.freeze=model.visual", r"model\.freeze: got 'model.visual', expected a list of str"),
    ],
)
def test_wrong_types_name_key_and_value(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=[override])


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("train.steps=0", r"train\.steps must be > 0, got 0"),
        ("loss.chunk_size=-4", r"loss\.chunk_size must be a positive int or 'auto', got -4"),
        ("data.max_bad_fraction=1.5", r"data\.max_bad_fraction must be in \[0, 1\], got 1\.5"),
        ("data.num_proc=0", r"data\.num_proc must be >= 1, got 0"),
        ("data.verify_images=decode", r"data\.verify_images: got 'decode'"),
        ("data.fingerprint=mtime", r"data\.fingerprint: got 'mtime'"),
        ("train.betas=[0.9]", r"train\.betas must be two numbers"),
    ],
)
def test_out_of_range(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=[override])


@pytest.mark.parametrize("chunk", ["true", "false"])
def test_raw_loss_is_refused_for_training(chunk):
    """``raw`` is an unreduced per-token loss: backward needs a scalar, in either head."""
    with pytest.raises(ConfigError, match=r"loss\.loss_type: 'raw' .* not a training loss"):
        config.load(overrides=[f"loss.chunk={chunk}", "loss.loss_type=raw"])


@pytest.mark.parametrize(
    "override", ["model.use_cache=false", "model.logits_to_keep=0", "loss.micro_batch_split=1", "data.template=qwen2vl"]
)
def test_removed_switches_are_unknown_keys(override):
    """Inference-only (KV cache, last logits) or never implemented: refused, not silently ignored."""
    with pytest.raises(ConfigError, match=rf"unknown key '{override.split('=')[0]}'"):
        config.load(overrides=[override])


SECTIONS = {f.name: f.type if isinstance(f.type, type) else getattr(config, f.type) for f in dataclasses.fields(config.Config)}
# names a section goes by in the code: ``t = cfg.train``-style aliases are found, these are conventions
SECTION_NAMES = {"t": "train", "ck": "checkpoint", **{s: s for s in SECTIONS}, **{f"{s}_cfg": s for s in SECTIONS}}


def _section_reads(root: Path) -> set[str]:
    """``section.field`` for every read of a config field in ``root``'s code but the config package: ``cfg.train.lr``,
    ``t.lr`` after ``t = cfg.train``, ``data.path`` with ``data: DataConfig``, ``self.cfg.x`` after
    ``self.cfg = cfg.profile``, ``getattr(cfg.lora, "r")``. Reading ``model.path`` is not ``data.path``."""
    types = {cls.__name__: name for name, cls in SECTIONS.items()}
    reads: set[str] = set()
    for path in root.rglob("*.py"):
        if root / "config" in path.parents:
            continue
        tree = ast.parse(path.read_text(), str(path))
        aliases = dict(SECTION_NAMES)

        def section(node, aliases=aliases) -> str | None:
            if isinstance(node, ast.Attribute) and node.attr in SECTIONS:
                return node.attr
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "self":
                return aliases.get(f"self.{node.attr}")
            return aliases.get(node.id) if isinstance(node, ast.Name) else None

        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    ann = arg.annotation
                    name = getattr(ann, "id", None) or getattr(ann, "attr", None) or getattr(ann, "value", None)
                    if isinstance(name, str) and name in types:
                        aliases[arg.arg] = types[name]
            if isinstance(node, ast.Assign):
                pairs = []
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += zip(target.elts, node.value.elts)
                    else:
                        pairs.append((target, node.value))
                for target, value in pairs:
                    s = section(value)
                    if s and isinstance(target, ast.Name):
                        aliases[target.id] = s
                    elif s and isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                        aliases[f"self.{target.attr}"] = s
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and (s := section(node.value)):
                reads.add(f"{s}.{node.attr}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2:
                s, name = section(node.args[0]), node.args[1]
                if s and isinstance(name, ast.Constant) and isinstance(name.value, str):
                    reads.add(f"{s}.{name.value}")
    return reads


def _unread(root: Path) -> list[str]:
    reads = _section_reads(root)
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f"{s}.{f.name}" not in reads]


def test_every_config_field_is_read_outside_the_config_module():
    """A switch validated but read by nothing else does nothing: it must be used or removed."""
    unread = _unread(Path(config.__file__).parent.parent)
    assert not unread, f"config fields read by nothing but qwenkit/config/: {unread}"


def test_the_field_check_fails_on_a_field_read_only_under_another_section(tmp_path):
    (tmp_path / "run.py").write_text(
        "def f(cfg, data: 'DataConfig'):\n    t = cfg.train\n    return cfg.model.path, t.lr, data.layout\n"
    )
    reads = _section_reads(tmp_path)
    assert {"model.path", "train.lr", "data.layout"} <= reads and "data.path" not in reads
    assert "data.path" in _unread(tmp_path) and "model.path" not in _unread(tmp_path)


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as e:
        config.load(overrides=["train.steps=0", "loss.loss_type=raw", "train.lr=-1"])
    assert len(e.value.problems) == 3


def test_unknown_fused_op():
    with pytest.raises(ConfigError, match=r"model\.fused_ops: unknown fused op 'gelu'"):
        config.load(overrides=["model.fused_ops=[rms_norm, gelu]"])


def test_fused_backend_is_refused_without_its_library(monkeypatch):
    monkeypatch.setattr(config.model, "installed", lambda library: library == "torch_npu")
    with pytest.raises(ConfigError, match=r"model\.fused_backend='cuda' needs liger-kernel, which is not installed"):
        config.load(overrides=["model.fused_backend=cuda"])
    assert config.load(overrides=["model.fused_backend=cuda", "model.fused_ops='off'"]).model.fused_backend == "cuda"
    assert config.load(overrides=["model.fused_backend=npu"]).model.fused_backend == "npu"
    with pytest.raises(ConfigError, match=r"model\.fused_backend"):
        config.load(overrides=["model.fused_backend=tpu"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)


def test_every_params_file_loads():
    files = sorted(Path(__file__).parent.parent.glob("params/*.yaml"))
    for f in files:
        config.load(f)


# ---------------------------------------------------------------------------------------------
# Values as people type them (issue 22, items 4, 5, 6, 9)


@pytest.mark.parametrize("text", ["1e-4", "2e-5", "1e9", "1E+3", "+5e-3", "1_0e-4", ".5e-2", "3.", "2.5e-4"])
def test_every_float_spelling_is_a_float_in_files_and_overrides(tmp_path, text):
    expected = float(text)
    assert config.load(overrides=[f"train.lr={text}"]).train.lr == expected
    p = tmp_path / "run.yaml"
    p.write_text(f"train:\n  lr: {text}\n  betas: [0.9, {text if expected < 1 else '0.99'}]\ndata:\n  max_aspect_ratio: 1e2\n")
    cfg = config.load(p)
    assert cfg.train.lr == expected and cfg.data.max_aspect_ratio == 100.0
    assert cfg.train.betas[1] == (expected if expected < 1 else 0.99)


def test_float_field_takes_what_python_float_takes_and_the_range_check_refuses_inf():
    assert config.load(overrides=["train.lr=' 3e-4 '"]).train.lr == 3e-4  # a quoted spelling float() takes
    for text in (".inf", "infinity", "-.inf", ".nan"):
        with pytest.raises(ConfigError, match=r"train\.lr must be (a finite number|> 0)"):
            config.load(overrides=[f"train.lr={text}"])
    with pytest.raises(ConfigError, match=r"train\.max_grad_norm must be a finite number, got inf"):
        config.load(overrides=["train.max_grad_norm=.inf"])
    with pytest.raises(ConfigError, match=r"train\.betas must be a finite number, got \[0\.9, inf\]"):
        config.load(overrides=["train.betas=[0.9, .inf]"])
    with pytest.raises(ConfigError, match=r"train\.steps: got 1000\.0, expected int"):
        config.load(overrides=["train.steps=1e3"])  # an int field stays an int


def test_fused_ops_off_as_the_readme_writes_it(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("model:\n  fused_ops: off\ndata:\n  shuffle: no\n  packing: On\n")
    cfg = config.load(p)
    assert cfg.model.fused_ops == "off" and cfg.data.shuffle is False and cfg.data.packing is True
    assert config.load(overrides=["model.fused_ops=off"]).model.fused_ops == "off"
    assert config.load(overrides=["data.shuffle=off", "loss.chunk=yes"]).data.shuffle is False


def test_a_bare_boolean_where_a_string_is_meant_says_why():
    with pytest.raises(ConfigError, match=r"model\.fused_ops: got False, expected .*YAML reads a bare false as a boolean; quote it"):
        config.load(overrides=["model.fused_ops=false"])
    with pytest.raises(ConfigError, match=r"train\.resume: got True, .*bare true as a boolean"):
        config.load(overrides=["train.resume=true"])
    with pytest.raises(ConfigError) as e:
        config.load(overrides=["train.steps=true"])
    assert "quote it" not in str(e.value)  # an int field: no string was meant


@pytest.mark.parametrize("value", ["", "'  '"])
def test_empty_output_dir_is_refused(value):
    with pytest.raises(ConfigError, match=r"train\.output_dir must name a directory"):
        config.load(overrides=[f"train.output_dir={value}"])


def test_empty_file_warmup_past_the_end_and_duplicate_keys_are_said(tmp_path, caplog):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with caplog.at_level("WARNING", logger="qwenkit.config"):
        assert config.load(empty) == config.load()
    assert f"{empty} is empty: the run uses the built-in defaults" in caplog.text
    caplog.clear()
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  steps: 5\n  lr: 0.1\n  steps: 7\n")
    with caplog.at_level("WARNING", logger="qwenkit.config"):
        assert config.load(twice, ["data.shuffle=false", "data.shuffle=true"]).train.steps == 7
    assert f"{twice}: key 'steps' given twice (lines 2 and 4); the last one is used" in caplog.text
    assert "override data.shuffle given twice ('false', then 'true')" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="qwenkit.config"):
        config.load(overrides=["train.steps=4", "train.warmup_steps=10"])
    assert "train.warmup_steps=10 exceeds train.steps=4" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="qwenkit.config"):
        config.load(overrides=["train.steps=4", "train.warmup_steps=4"])
    assert not caplog.text


def test_typed_values_reach_qwenkit_train(tmp_path, monkeypatch, capsys):
    """Through the CLI: the override strings a shell passes, checked before any process starts."""
    from qwenkit import cli

    started = []
    monkeypatch.setattr("qwenkit.launch.spawn", lambda cmd, *a, **k: started.append(cmd) or 0)
    out = tmp_path / "run"
    assert cli.main(["train", "train.lr=1e-4", "model.fused_ops=off", f"train.output_dir={out}"]) == 0, capsys.readouterr().err
    written = config.load(out / "config.yaml")
    assert written.train.lr == 1e-4 and written.model.fused_ops == "off"
    assert cli.main(["train", "train.output_dir="]) == 2
    assert "train.output_dir must name a directory" in capsys.readouterr().err
    assert len(started) == 1


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["dpo.beta=0.5"], r"dpo\.beta set but train\.objective='sft'"),
        (["train.objective=dpo", "dpo.beta=0"], r"dpo\.beta must be > 0"),
        (["train.objective=dpo", "dpo.label_smoothing=0.5"], r"dpo\.label_smoothing must be in \[0, 0\.5\)"),
        (["train.objective=dpo", "dpo.loss=hinge", "dpo.label_smoothing=0.1"], r"applies to dpo\.loss sigmoid or simpo"),
        (["train.objective=dpo", "dpo.gamma=0.5"], r"dpo\.gamma .* applies to dpo\.loss=simpo"),
        (["train.objective=dpo", "dpo.loss=simpo", "dpo.precompute_ref=true"], r"SimPO has no reference"),
        (["train.objective=dpo", "dpo.sft_weight=-1"], r"dpo\.sft_weight must be >= 0"),
        (["train.objective=dpo", "data.packing=true"], r"does not support data\.packing=true"),
        (["train.objective=dpo", "data.max_tokens_per_batch=2048"], r"does not support data\.max_tokens_per_batch"),
        (["train.objective=dpo", "parallel.nproc=2", "parallel.sp_size=2"], r"does not support parallel\.sp_size=2"),
        (["train.objective=dpo", "loss.chunk=false"], r"dpo needs loss\.chunk=true"),
        (["train.objective=dpo", "data.layout=messages"], r"data\.layout must be auto"),
        (["train.objective=dpo", "data.eval_fraction=0.1"], r"does not support data\.eval_fraction"),
        (["train.objective=ppo"], r"train\.objective"),
    ],
)
def test_dpo_settings_and_what_they_cannot_go_with_are_refused(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=overrides)


def test_a_dpo_beta_grid_is_valid():
    for beta in ("0.05", "0.5"):
        cfg = config.load(overrides=["train.objective=dpo", f"dpo.beta={beta}", "dpo.loss=simpo", "dpo.gamma=0.3"])
        assert cfg.dpo.beta == float(beta)


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["parallel.ep_size=0"], r"parallel\.ep_size must be >= 1"),
        (["parallel.nproc=4", "parallel.ep_size=3"], r"parallel\.ep_size=3 must divide parallel\.nproc=4"),
        (["parallel.nproc=4", "parallel.ep_size=2", "parallel.sp_size=2"], r"not built with parallel\.sp_size > 1"),
        (["parallel.nproc=4", "parallel.ep_size=2", "parallel.hsdp_replicas=2"], r"not built with parallel\.hsdp_replicas"),
        (["parallel.nproc=2", "parallel.ep_size=2", "parallel.cpu_offload=true"], r"not built with parallel\.cpu_offload"),
        (["parallel.nproc=2", "parallel.ep_size=2", "lora.r=8"], r"not built with LoRA"),
        (["parallel.nproc=2", "parallel.ep_size=2", "train.objective=dpo"], r"not built with train\.objective other than sft"),
    ],
)
def test_expert_parallel_settings_it_cannot_run_are_refused(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=overrides)


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
    cfg = config.load(overrides=[f"model.name={family}", f"parallel.nproc={ep}", f"parallel.ep_size={ep}"])
    problems = families.problems(cfg, tiny_checkpoint(family))
    if pattern is None:
        assert problems == []
    else:
        assert any(re.search(pattern, p) for p in problems), problems
