"""qwenkit.config.data: the data section's ranges and allowed names, refused by key and value."""

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("data.max_bad_fraction=1.5", r"data\.max_bad_fraction must be in \[0, 1\], got 1\.5"),
        ("data.num_proc=0", r"data\.num_proc must be >= 1, got 0"),
        ("data.verify_images=decode", r"data\.verify_images: got 'decode'"),
        ("data.fingerprint=mtime", r"data\.fingerprint: got 'mtime'"),
    ],
)
def test_out_of_range(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=[override])
