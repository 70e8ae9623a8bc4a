"""The run's event stream (``events.jsonl``): what a real run writes, compared with what it did
(its metrics, its checkpoints); the reader on the files a crashed writer leaves; and the
``failed`` event every failed invocation ends with: a rank's own, or the launcher's for a failure
no rank recorded (a refusal, a rank exiting without a Python exception, torchrun killed). A rank
killed by SIGKILL and a refusal inside a sweep reach the ledger in tests/sweep/test_scheduler.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qwenkit import config as qconfig
from qwenkit import launch, records
from qwenkit.engine.run import events, metrics, train

ROOT = Path(__file__).resolve().parents[2]

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


# rank 1 reports a failure of its own first, as the peer of a dead rank does (a connection error);
# then rank 0 exits 3 without a Python exception: torchrun sees rank 0 fail first
_PEER_THEN_EXIT = """
import os, sys, time
from qwenkit.engine.run import events
out = sys.argv[1]
if os.environ["RANK"] == "1":
    events.EventLog(out, 1).failed(RuntimeError("Connection closed by peer"), "qwenkit train: rank 1 failed: RuntimeError")
    time.sleep(120)
while not events.read(out):
    time.sleep(0.05)
os._exit(3)
"""


def _torchrun(out: Path, nproc: int, *target: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qwenkit.torchrun", f"--events-dir={out}", "--standalone",
                           f"--nproc-per-node={nproc}", *target], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.mark.slow
def test_a_rank_that_exits_without_an_exception_gets_the_launchers_failed_event(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(_PEER_THEN_EXIT)
    proc = _torchrun(tmp_path, 2, str(script), str(tmp_path))
    assert proc.returncode == 3, proc.stderr
    every = events.read(tmp_path)
    assert [(e["rank"], e["by"]) for e in every] == [(1, "rank"), (0, "launcher")]
    verdict = every[1]
    assert verdict | {"time": 0} == {
        "event": "failed", "time": 0, "rank": 0, "by": "launcher", "error": "exited", "exit_code": 3, "signal": None,
        "message": "exited with 3 without reporting a Python exception", "summary": verdict["summary"]}  # fmt: skip
    assert verdict["summary"] in proc.stderr  # the console line, for people
    assert verdict["summary"].startswith("qwenkit train: rank 0 (pid ") and "failed first: exited with 3" in verdict["summary"]
    assert events.failure(every) == verdict["summary"]  # the first to fail, not the peer that reported first


@pytest.mark.slow
def test_a_rank_that_raises_reports_itself_and_the_launcher_adds_nothing(tmp_path, tiny_path):
    # freezing every module passes every check before spawn and fails in the trainer
    cfg = qconfig.load(overrides=["model.freeze=[model,lm_head]", f"train.output_dir={tmp_path}"])
    qconfig.write_config(cfg, tmp_path)
    proc = _torchrun(tmp_path, 1, "-m", "qwenkit.engine.run.rank", "--config", str(tmp_path / "config.yaml"))
    assert proc.returncode == 1, proc.stderr
    (failed,) = [e for e in events.read(tmp_path) if e["event"] == "failed"]
    assert (failed["rank"], failed["by"], failed["error"]) == (0, "rank", "ValueError")
    assert "no trainable parameters" in failed["message"]
    assert failed["summary"].startswith("qwenkit train: rank 0 failed: ValueError") and failed["summary"] in proc.stderr
    assert events.failure(events.read(tmp_path)) == failed["summary"]


def test_the_launcher_records_a_refusal_and_a_killed_torchrun(tmp_path, tiny_path, monkeypatch, capsys):
    fresh = tmp_path / "fresh"
    bad = ["model.freeze=[model.nope]", "data.tiny_samples=8", "parallel.nproc=1"]
    assert launch.launch(None, [*bad, f"train.output_dir={fresh}"]) == 2
    assert not fresh.exists()  # a refused new run leaves no folder behind
    run = tmp_path / "run"
    run.mkdir()  # a sweep's trial folder, a run resumed: the refusal goes into its stream
    assert launch.launch(None, [*bad, f"train.output_dir={run}"]) == 2
    (refused,) = events.read(run)
    assert (refused["by"], refused["error"], refused["exit_code"], refused["rank"]) == ("launcher", "refused", 2, None)
    assert "model.freeze: no module 'model.nope'" in refused["message"]
    assert refused["summary"].startswith("qwenkit train: invalid run: ") and refused["message"] in capsys.readouterr().err

    # torchrun killed (its ranks die with it): no rank and no wrapper wrote a word
    spawn = launch.spawn

    def killed(cmd, env, pass_fds=()):
        return spawn([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], env)

    monkeypatch.setattr(launch, "spawn", killed)
    assert launch.launch(None, ["data.tiny_samples=8", "parallel.nproc=1", f"train.output_dir={run}"]) == 128 + signal.SIGKILL
    last = events.read(run)[-1]
    assert (last["by"], last["error"], last["signal"], last["exit_code"]) == ("launcher", "torchrun", "SIGKILL", 137)
    assert events.failure(events.read(run)[1:]) == "qwenkit train: torchrun was killed by SIGKILL without naming a failed rank"
