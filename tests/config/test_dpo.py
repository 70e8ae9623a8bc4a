"""qwenkit.config.dpo: the DPO section's ranges, and what train.objective=dpo cannot go with, refused by name."""

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


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
        (["train.objective=dpo", "data.max_tokens_per_batch=2048"], r"does not support data\.max_tokens_per_batch"),
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


@pytest.mark.parametrize("loss", ["sigmoid", "ipo", "simpo"])
@pytest.mark.parametrize("packing", ["false", "true"])
def test_dpo_under_sequence_parallelism_is_valid_padded_and_packed(loss, packing):
    """Its per-sequence log-probs are gathered from the slices (tests/engine/objectives/test_sequence_parallel_rl.py)."""
    cfg = config.load(overrides=["train.objective=dpo", f"dpo.loss={loss}", "parallel.nproc=2", "parallel.sp_size=2",
                                 f"data.packing={packing}"])  # fmt: skip
    assert cfg.parallel.sp_size == 2 and cfg.data.packing == (packing == "true")
