"""qwenkit.config.checkpoint: how often a run saves and how many checkpoints it keeps, refused by name."""

import re

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("checkpoint.every=-1", r"checkpoint\.every must be >= 0, got -1"),
        ("checkpoint.keep_last=0", r"checkpoint\.keep_last must be >= 1, got 0"),
    ],
)
def test_out_of_range(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=[override])


def test_one_setting_under_its_two_names_is_refused():
    message = "checkpoint.async and checkpoint.async_save are one setting, given twice: keep checkpoint.async"
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.load(overrides=["checkpoint.async=true", "checkpoint.async_save=false"])
    assert config.load(overrides=["checkpoint.async=true"]).checkpoint.async_save is True


def test_the_yaml_key_async_is_the_field_async_save(tmp_path):
    """``async`` is a Python keyword: the field is ``async_save``, the key people write is ``async``."""
    p = tmp_path / "run.yaml"
    p.write_text("checkpoint:\n  async: true\n  every: 0\n")
    cfg = config.load(p)
    assert cfg.checkpoint.async_save is True and cfg.checkpoint.every == 0
    assert config.load(overrides=["checkpoint.async=true"]).checkpoint.async_save is True
