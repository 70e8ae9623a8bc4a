"""qwenkit.engine.run.metrics: what a rank's writer puts in its JSONL (long format, units, the rank), how a resumed
run's repeated step and a half-written last line read back, and a run's headline numbers (``final_metrics``)
against the same numbers computed by hand from the rows written. The trackers: engine/test_trackers.py."""

from __future__ import annotations

import json
import statistics

import torch

from qwenkit.engine.run import metrics
from qwenkit.rundir import RunDir

CPU = torch.device("cpu")


def _write(out, rank, steps):
    writer = metrics.MetricsWriter(out, rank, CPU)
    for step, values in steps:
        writer.write(step, values)
    writer.close()


def test_rows_are_long_format_with_unit_rank_and_device(tmp_path):
    _write(tmp_path, 1, [(3, {"loss": 2.5, "lr": 1e-3, "lr/model.visual.merger": 1e-5})])
    rows = metrics.read(tmp_path / "metrics" / "rank-00001.jsonl")
    assert [(r["metric"], r["x"], r["value"], r["unit"]) for r in rows] == [
        ("loss", 3, 2.5, metrics.UNITS["loss"]), ("lr", 3, 1e-3, metrics.UNITS["lr"]),
        ("lr/model.visual.merger", 3, 1e-5, metrics.UNITS["lr"]),  # a group's LR has the LR's unit
    ]  # fmt: skip
    assert all(r["rank"] == 1 and r["series"] == "rank 1" and r["device"] == "cpu" and r["x_name"] == "step" for r in rows)
    assert len({r["timestamp"] for r in rows}) == 1  # one step's rows, one time


def test_a_repeated_step_keeps_the_last_row_and_a_cut_line_is_left_out(tmp_path):
    _write(tmp_path, 0, [(1, {"loss": 3.0}), (2, {"loss": 2.0})])
    _write(tmp_path, 0, [(2, {"loss": 1.5}), (3, {"loss": 1.0})])  # resumed from step 1: step 2 again
    path = tmp_path / "metrics" / "rank-00000.jsonl"
    with path.open("a") as f:
        f.write('{"metric": "loss", "x": 4, "val')  # a rank still writing
    rows = metrics.read(tmp_path)
    assert len(rows) == 4  # both rows of step 2 are kept
    assert metrics.series(rows, "loss") == {1: 3.0, 2: 1.5, 3: 1.0}


def test_final_metrics_are_the_rows_summarised(tmp_path):
    rank0 = [(s, {"loss": 4.0 - s, "tokens_per_s": 100.0 * s, "step_time": 0.5 + s % 2, "peak_memory": 10.0 + s})
             for s in range(1, 6)]  # fmt: skip
    rank0 += [(0, {"eval_loss": 3.5}), (5, {"eval_loss": 2.0, "eval_accuracy": 0.25})]
    _write(tmp_path, 0, rank0)
    _write(tmp_path, 1, [(s, {"loss": 9.0, "peak_memory": 40.0 + s}) for s in range(1, 6)])  # rank 1: the largest peak
    RunDir(tmp_path).parameters.write_text(json.dumps({"vision": {"total": 30, "trainable": 0},
                                                       "language": {"total": 70, "trainable": 12}}))  # fmt: skip
    got = metrics.final_metrics(tmp_path, wall_time=12.5)
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
    rank0_of = lambda m: [r["value"] for r in rows if r["metric"] == m]  # noqa: E731
    assert got == {
        "eval_loss": 2.0, "eval_accuracy": 0.25, "loss": 4.0 - 5,  # the last of rank 0's
        "tokens_per_s": statistics.median(rank0_of("tokens_per_s")), "step_time": statistics.median(rank0_of("step_time")),
        "peak_memory": 45.0, "wall_time": 12.5, "trainable_params": 12, "steps": 5,
    }  # fmt: skip
    assert set(got) == set(metrics.FINAL)
    empty = metrics.final_metrics(tmp_path / "nothing")
    assert empty == {**dict.fromkeys(metrics.FINAL), "steps": 0}



def test_grpo_metrics_have_units_and_dpo_rewards_stay_nats():
    unit = metrics.unit_of
    assert [unit(m) for m in ("reward", "rewards/exact/mean", "rewards/my_reward/std", "kl", "entropy")] == \
        ["1", "1", "1", "nat", "nat"]  # fmt: skip
    assert [unit(m) for m in ("completions/max_length", "completions/clipped_ratio", "clip_ratio/low_min")] == \
        ["token", "1", "1"]  # fmt: skip
    assert unit("rewards/chosen") == unit("eval_rewards/margins") == "nat"  # DPO's: beta x log-ratios
