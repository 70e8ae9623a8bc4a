"""qwenkit.config.lora: LoRA's ranges, the settings that mean nothing with LoRA off, and the head
that takes no adapter (targets against the model tree: the launcher, tests/model/test_lora.py)."""

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["lora.r=-1"], r"lora\.r must be >= 0 \(0: off\), got -1"),
        (["lora.use_dora=true"], r"lora\.use_dora set but lora\.r=0 \(LoRA off\)"),
        (["lora.r=8", "lora.alpha=0"], r"lora\.alpha must be > 0, got 0"),
        (["lora.r=8", "lora.dropout=1.0"], r"lora\.dropout must be in \[0, 1\), got 1\.0"),
        (["lora.r=8", "lora.target_modules=[]"], r"lora\.target_modules must not be empty"),
        (["lora.r=8", "lora.target_modules=[q_proj, lm_head]"], r"lm_head computes the chunked loss and takes no adapter"),
        (["lora.target_experts=true"], r"lora\.target_experts set but lora\.r=0"),
        (["lora.r=8", "lora.target_experts=true", "lora.dropout=0.1"], r"lora\.target_experts=true needs lora\.dropout=0"),
        (["lora.r=8", "lora.target_experts=true", "lora.use_dora=true"], r"lora\.target_experts=true does not work with lora\.use_dora"),
    ],
)
def test_refused_by_name(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=overrides)


def test_lora_on_with_its_defaults_is_valid():
    cfg = config.load(overrides=["lora.r=8", "lora.modules_to_save=[lm_head]"])
    assert cfg.lora.r == 8 and cfg.lora.modules_to_save == ["lm_head"]
