"""Config loading: every problem is reported with its key path before any model is built."""

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


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
        ("loss.chunk_size=-4", r"loss\.chunk_size must be > 0 or 'auto', got -4"),
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


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["loss.loss_type=raw"], r"loss\.loss_type: 'raw'.*not allowed with loss\.chunk=true"),
        (["loss.micro_batch_split=2"], r"loss\.micro_batch_split: got 2, must be 1 with loss\.chunk=true"),
        (["model.use_cache=true"], r"model\.use_cache: got true, must be false with loss\.chunk=true"),
        (["model.logits_to_keep=1"], r"model\.logits_to_keep: got 1, must be 0 with loss\.chunk=true"),
    ],
)
def test_illegal_combinations_with_chunk_loss(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=overrides)


@pytest.mark.parametrize(
    "override", ["loss.loss_type=raw", "loss.micro_batch_split=2", "model.use_cache=true", "model.logits_to_keep=1"]
)
def test_same_settings_are_legal_without_chunk_loss(override):
    config.load(overrides=["loss.chunk=false", override])


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as e:
        config.load(overrides=["train.steps=0", "loss.loss_type=raw", "train.lr=-1"])
    assert len(e.value.problems) == 3


def test_unknown_fused_op():
    with pytest.raises(ConfigError, match=r"model\.fused_ops: unknown op 'gelu'"):
        config.load(overrides=["model.fused_ops=[rms_norm, gelu]"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)


def test_every_params_file_loads():
    from pathlib import Path

    files = sorted(Path(__file__).parent.parent.glob("params/*.yaml"))
    for f in files:
        config.load(f)
