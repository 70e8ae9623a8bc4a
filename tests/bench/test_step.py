"""MFU has one rule (:func:`qwenkit.bench.step.mfu`): above 1 it is a measurement error, in the
benchmark and in notebook 04 alike."""

from __future__ import annotations

from qwenkit.bench.step import mfu
from qwenkit.notebooks import perf


def test_an_mfu_above_one_is_refused_by_the_notebook_too(tmp_path):
    assert mfu(0.5e9, 1.0, 1e9) == 0.5 and mfu(1.17e9, 1.0, 1e9) is None
    assert perf.utilisation([1000.0], 5e8, 10, {"flops_per_s": 1e9})["mfu"] == 0.5  # 1 s steps
    util = perf.utilisation([1000.0], 2e9, 10, {"flops_per_s": 1e9})
    assert util["mfu"] is None
    perf.write_model_step(tmp_path, util, "cpu")  # the refused value is left out of the CSV
    assert "mfu" not in (tmp_path / "model_step.csv").read_text() and "step_ms" in (tmp_path / "model_step.csv").read_text()
