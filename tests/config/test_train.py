"""qwenkit.config.train: the run's steps, optimizer and output folder, refused by name when out of range."""

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


@pytest.mark.parametrize("value", ["", "'  '"])
def test_empty_output_dir_is_refused(value):
    with pytest.raises(ConfigError, match=r"train\.output_dir must name a directory"):
        config.load(overrides=[f"train.output_dir={value}"])


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("train.steps=0", r"train\.steps must be > 0, got 0"),
        ("train.betas=[0.9]", r"train\.betas must be two numbers"),
        ("train.lr=-1", r"train\.lr must be > 0"),
    ],
)
def test_out_of_range(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=[override])
