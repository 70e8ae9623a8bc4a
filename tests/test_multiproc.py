"""The test harness's own rules: a timeout catches a hang, not a slow machine."""

from __future__ import annotations

import time

import multiproc


def _slow_rank(rank: int, seconds: float) -> None:
    time.sleep(seconds)


def test_rank_timeouts_are_generous_and_scaled(monkeypatch):
    assert multiproc.DEFAULT_TIMEOUT_S >= 900  # a 60 s fixture was killed at 180 s under load
    monkeypatch.setenv("QWENKIT_TEST_TIMEOUT_SCALE", "100")
    assert multiproc.scaled(1.5) == 150
    # starting a rank (spawn, import torch) alone takes longer than 0.5 s: passes only when scaled
    assert multiproc.run_ranks(_slow_rank, 1, 0.0, timeout=0.5) == [0]
    monkeypatch.setenv("QWENKIT_TEST_TIMEOUT_SCALE", "1")
    assert multiproc.run_ranks(_slow_rank, 1, 600.0, timeout=1.0) != [0]  # a hang is still stopped
