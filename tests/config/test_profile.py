"""qwenkit.config.profile: the profiler window's lengths, refused by name."""

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("profile.wait=-1", r"profile\.wait must be >= 0, got -1"),
        ("profile.warmup=-2", r"profile\.warmup must be >= 0, got -2"),
        ("profile.active=0", r"profile\.active must be >= 1, got 0"),
    ],
)
def test_out_of_range(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=["profile.enabled=true", override])


def test_a_window_without_waiting_is_valid():
    cfg = config.load(overrides=["profile.enabled=true", "profile.wait=0", "profile.warmup=0", "profile.active=1"])
    assert (cfg.profile.wait, cfg.profile.warmup, cfg.profile.active) == (0, 0, 1)
