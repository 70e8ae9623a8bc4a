"""The run's event stream (``events.jsonl``): what a real run writes, compared with what it did
(its metrics, its checkpoints); and the reader on the files a crashed writer leaves. A failing
rank's event is checked through the sweep (tests/test_sweep.py, the failing trial's ledger row)."""

from __future__ import annotations

import json

import pytest

from qwenkit import config as qconfig
from qwenkit import records
from qwenkit.engine import events, metrics, train

BASE = ["train.resume=none", "data.tiny_samples=16", "data.tiny_eval_samples=0", "train.micro_batch_size=2",
        "train.steps=4", "checkpoint.every=2", "train.log_every=1"]  # fmt: skip


def test_a_stopped_and_resumed_run_tells_its_story(tmp_path):
    cfg = qconfig.load(overrides=[*BASE, "train.stop_after=2", f"train.output_dir={tmp_path}"])
    train.Trainer(cfg).run()
    follower = events.Follower(tmp_path)  # from here on: the second invocation only
    train.Trainer(qconfig.load(overrides=[*BASE, "train.resume=auto", f"train.output_dir={tmp_path}"])).run()
    every = events.read(tmp_path)
    kinds = [e["event"] for e in every]
    assert kinds == ["started", "step", "step", "checkpoint", "stopped",
                     "started", "resumed", "step", "step", "checkpoint", "stopped"]  # fmt: skip
    first, second = every[:5], follower.poll()
    assert second == every[5:] and follower.poll() == []
    assert events.last(first, "stopped") | {"time": 0} == {"event": "stopped", "time": 0, "rank": 0, "step": 2,
                                                           "reason": "stop_after", "exit_code": 75}  # fmt: skip
    assert events.last(second, "stopped")["reason"] == "completed" and events.last(second, "stopped")["exit_code"] == 0
    assert events.resumed_step(first) is None and events.resumed_step(second) == 2
    assert events.last(second, "resumed")["checkpoint"] == str(tmp_path / "checkpoints" / "step-00000002")
    loss = metrics.series(metrics.read(tmp_path), "loss")
    assert {e["step"]: e["loss"] for e in every if e["event"] == "step"} == loss  # the metrics' own values
    assert [e["path"] for e in every if e["event"] == "checkpoint"] == [
        str(tmp_path / "checkpoints" / f"step-{s:08d}") for s in (2, 4)]  # fmt: skip
    assert events.describe(second[2]).startswith("step 3/4  loss ")


def test_the_reader_skips_what_a_crashed_writer_left(tmp_path):
    log = events.EventLog(tmp_path, 0)
    log.write("step", step=1, steps=2, loss=1.0)
    with log.path.open("a") as f:
        f.write('{"event": "step", "ste')  # killed mid-line
    assert [e["step"] for e in events.read(tmp_path)] == [1]
    follower = events.Follower(tmp_path)
    follower.offset = 0
    assert [e["step"] for e in follower.poll()] == [1]  # the cut line waits: it may still be written
    events.EventLog(tmp_path, 0).write("started", world_size=1, steps=2)  # the next invocation starts a new line
    assert [e["event"] for e in events.read(tmp_path)] == ["step", "started"]
    assert [e["event"] for e in follower.poll()] == ["started"]
    with pytest.raises(ValueError, match="event kind must be one of"):
        log.write("finished")
    events.EventLog(tmp_path, 1, enabled=False).write("step", step=9)  # not rank 0: nothing written
    assert len(events.read(tmp_path)) == 2


def test_jsonl_reader_names_the_file_and_line_of_a_bad_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\nnot json\n{"a": 2}\n{"a": 3')
    with pytest.raises(ValueError, match=r"rows.jsonl: line 2 is not JSON"):
        records.read_jsonl(path)
    assert records.read_jsonl(path, skip_bad=True) == [{"a": 1}, {"a": 2}]  # the cut last line left out
    path.write_text('{"a": 1}\n{"a": 2}')  # a complete last row without its newline is a row
    assert records.read_jsonl(path) == [{"a": 1}, {"a": 2}]
    records.append_jsonl(tmp_path / "b.jsonl", {"x": [1]}, sync=True)
    assert json.loads((tmp_path / "b.jsonl").read_text()) == {"x": [1]}
