"""qwenkit.config.loader: YAML 1.2 files and dotted overrides, values typed against the fields as people
type them, unknown keys with the near one, and what a file says twice or not at all."""

from pathlib import Path

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


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
        # the key as typed, not the field behind it (async is a Python keyword: the field is async_save)
        ("checkpoint.async=maybe", r"checkpoint\.async: got 'maybe', expected bool"),
    ],
)
def test_wrong_types_name_key_and_value(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=[override])


@pytest.mark.parametrize(
    "override", ["model.use_cache=false", "model.logits_to_keep=0", "loss.micro_batch_split=1", "data.template=qwen2vl"]
)
def test_removed_switches_are_unknown_keys(override):
    """Inference-only (KV cache, last logits) or never implemented: refused, not silently ignored."""
    with pytest.raises(ConfigError, match=rf"unknown key '{override.split('=')[0]}'"):
        config.load(overrides=[override])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)


def test_every_params_file_loads():
    files = sorted(Path(__file__).parents[2].glob("params/*.yaml"))
    for f in files:
        config.load(f)


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

    started = []  # what the ranks would read: the file after --config (config.yaml is rank 0's to write)
    monkeypatch.setattr("qwenkit.launch.spawn", lambda cmd, *a, **k: started.append(config.load(cmd[cmd.index("--config") + 1])) or 0)
    out = tmp_path / "run"
    assert cli.main(["train", "train.lr=1e-4", "model.fused_ops=off", f"train.output_dir={out}"]) == 0, capsys.readouterr().err
    written = started[0]
    assert written.train.lr == 1e-4 and written.model.fused_ops == "off"
    assert cli.main(["train", "train.output_dir="]) == 2
    assert "train.output_dir must name a directory" in capsys.readouterr().err
    assert len(started) == 1


def test_a_bad_type_does_not_hide_the_range_errors_beside_it():
    """All problems in one error: the range checks run on the keys that typed, while the one that did
    not is reported once (its range rule, run on the default it fell back to, says nothing of it)."""
    with pytest.raises(ConfigError) as e:
        config.load(overrides=["train.steps=many", "train.lr=-1", "grpo.beta=0.1"])
    problems = e.value.problems
    assert any(p.startswith("train.steps: got 'many'") for p in problems), problems
    assert any(p.startswith("train.lr must be > 0") for p in problems), problems
    assert any(p.startswith("grpo.beta set but train.objective='sft'") for p in problems), problems
    assert not any("train.steps" in p for p in problems if not p.startswith("train.steps: got")), problems
