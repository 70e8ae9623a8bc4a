"""qwenkit.config.parallel: the process counts, the rendezvous a restart needs, and what sequence
parallelism needs of the loss and the attention (the model's head counts: the launcher)."""

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["parallel.nproc=0"], r"parallel\.nproc must be >= 1, got 0"),
        (["parallel.hsdp_replicas=0"], r"parallel\.hsdp_replicas must be >= 1, got 0"),
        (["parallel.timeout_s=0"], r"parallel\.timeout_s must be >= 1 \(seconds\), got 0"),
        (["parallel.max_restarts=-1"], r"parallel\.max_restarts must be in \[0, 100\], got -1"),
        (["parallel.max_restarts=99999999999"], r"parallel\.max_restarts must be in \[0, 100\], got 99999999999"),
        (["parallel.rendezvous=static", "parallel.max_restarts=2"], r"parallel\.max_restarts=2 needs parallel\.rendezvous=c10d"),
        (["parallel.sp_size=0"], r"parallel\.sp_size must be >= 1, got 0"),
        (["parallel.nproc=3", "parallel.sp_size=2"], r"parallel\.sp_size=2 must divide parallel\.nproc=3"),
        (["parallel.nproc=2", "parallel.sp_size=2", "loss.chunk=false"], r"parallel\.sp_size=2 needs loss\.chunk=true"),
        (["parallel.nproc=2", "parallel.sp_size=2", "loss.loss_type=sample_mean"], r"supports loss\.loss_type=token_mean only"),
    ],
)
def test_refused_by_name(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=overrides)


def test_sequence_parallel_within_its_rules_is_valid():
    cfg = config.load(overrides=["parallel.nproc=4", "parallel.sp_size=2", "parallel.rendezvous=c10d", "parallel.max_restarts=1"])
    assert cfg.parallel.sp_size == 2 and cfg.parallel.max_restarts == 1


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["parallel.ep_size=0"], r"parallel\.ep_size must be >= 1"),
        (["parallel.nproc=4", "parallel.ep_size=3"], r"parallel\.ep_size=3 must divide parallel\.nproc=4"),
        (["parallel.nproc=2", "parallel.ep_size=2", "parallel.cpu_offload=true"], r"not built with parallel\.cpu_offload"),
    ],
)
def test_expert_parallel_settings_it_cannot_run_are_refused(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=overrides)
