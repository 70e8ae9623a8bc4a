"""qwenkit.config.loss: the training loss types and the chunk size."""

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


@pytest.mark.parametrize("chunk", ["true", "false"])
def test_raw_loss_is_refused_for_training(chunk):
    """``raw`` is an unreduced per-token loss: backward needs a scalar, in either head."""
    with pytest.raises(ConfigError, match=r"loss\.loss_type: 'raw' .* not a training loss"):
        config.load(overrides=[f"loss.chunk={chunk}", "loss.loss_type=raw"])


def test_chunk_size_is_a_positive_int_or_auto():
    with pytest.raises(ConfigError, match=r"loss\.chunk_size must be a positive int or 'auto', got -4"):
        config.load(overrides=["loss.chunk_size=-4"])
    assert config.load(overrides=["loss.chunk_size=auto"]).loss.chunk_size == "auto"
    assert config.load(overrides=["loss.chunk_size=7"]).loss.chunk_size == 7
