"""qwenkit.sweep.scheduler (``qwenkit sweep run``): device slots, and real sweeps of the tiny model on
one rank: a trial the launcher refuses, a trial whose rank is killed and then the sweep killed in the
middle, both resumed (the trial's losses against an uninterrupted trial of the same training), and
MLflow beside the JSONL. A rank's own failure report: tests/engine/run/test_events.py."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwenkit import config as qconfig
from qwenkit import sweep
from qwenkit.engine.run import events, metrics
from qwenkit.model.families import registry as families
from qwenkit.notebooks import compare
from qwenkit.sweep import ledger
from sweep.sweeps import ROOT, SMALL, run_qwenkit, write_sweep


def test_device_slots_split_the_visible_devices():
    assert sweep.device_slots("cuda", 2, 2, {}, 4) == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    env = {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}
    assert sweep.device_slots("npu", 4, 1, env, 8) == [{"ASCEND_RT_VISIBLE_DEVICES": d} for d in "4567"]
    assert sweep.device_slots("cpu", 2, 1, {}, 0) == [{}, {}]
    with pytest.raises(sweep.SweepError, match="needs 6 cuda devices, 4 visible"):
        sweep.device_slots("cuda", 3, 2, {}, 4)


def test_parallel_on_cpu_is_refused_unless_asked(tmp_path, tiny_path):
    # tiny_path: the tiny checkpoint already written (its first write draws a progress bar on stderr)
    proc = run_qwenkit("sweep", "run", str(write_sweep(tmp_path, grid={"train.lr": [0.001, 0.002]})), "--out",
                    str(tmp_path / "out"), "--parallel", "2")  # fmt: skip
    assert proc.returncode == 2 and "--cpu-parallel" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_report_to_mlflow_is_refused_when_mlflow_is_missing(monkeypatch):
    monkeypatch.delitem(sys.modules, "mlflow", raising=False)  # another test file of this worker may have imported it
    if importlib.util.find_spec("mlflow") is not None:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(qconfig.ConfigError, match="train.report_to: mlflow needs the mlflow package"):
        qconfig.load(overrides=["train.report_to=[mlflow]"])


# ---------------------------------------------------------------------------------------------
# Real sweeps


@pytest.mark.slow
def test_a_trial_the_launcher_refuses_is_recorded_with_its_reason(tmp_path, capsys):
    # the data file is there when the sweep checks its trials and gone when the trial starts
    data = tmp_path / "rows.jsonl"
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    data.write_text("".join(json.dumps({"messages": reply}) + "\n" for _ in range(8)))  # a step's rows and more
    s = sweep.load(write_sweep(tmp_path, trials=[{"data.path": str(data)}]), tmp_path / "out")
    data.unlink()
    (row,) = sweep.run(s)
    assert (row["status"], row["exit_code"]) == ("failed", 2)
    assert row["error"] == f"qwenkit train: invalid run: data.path={str(data)!r} does not exist"  # the launcher's event
    assert capsys.readouterr().out.rstrip().endswith(f"failed, exit code 2: {row['error']}")


@pytest.mark.slow
@pytest.mark.long
def test_parallel_trials_on_cpu_when_asked(tmp_path):
    path = write_sweep(tmp_path, grid={"train.lr": [0.003, 0.001]})
    out = tmp_path / "out"
    proc = run_qwenkit("sweep", "run", str(path), "--out", str(out), "--parallel", "2", "--cpu-parallel")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = ledger.read(out)
    started = [r for r in rows if r["status"] == "running"]
    ended = [r for r in rows if r["status"] == "done"]
    assert len(started) == len(ended) == 2
    assert rows.index(started[1]) < rows.index(ended[0])  # the second started before the first ended
    for r in ended:
        assert r["metrics"]["steps"] == 4


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill(proc: subprocess.Popen, rank_only: bool = False) -> None:
    """SIGKILL the sweep's process tree (the sweep, the trial's launcher, torchrun, the rank), or
    only the trial's rank."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            if not rank_only or ("qwenkit.engine.run.rank" in argv and "qwenkit.torchrun" not in argv):
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, FileNotFoundError):
            pass


def _until(proc: subprocess.Popen, done, what: str) -> None:
    deadline = time.monotonic() + 600
    while not done():
        assert proc.poll() is None, f"the sweep ended before {what}: " + proc.stdout.read()
        assert time.monotonic() < deadline, f"no {what} in 600 s"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_killed_rank_and_a_killed_sweep_resume_to_the_uninterrupted_losses(tmp_path, capsys):
    # Trial 1 is stopped twice in the middle: its rank SIGKILLed (the trial fails with the launcher's
    # event, the sweep goes on with trial 2), then, resumed, the whole sweep (the trial stays
    # `running`). Trial 2 is the same training uninterrupted (checkpoint.keep_last changes no step).
    long = {"train.lr": 0.002, "train.steps": 16, "checkpoint.every": 2}
    path = write_sweep(tmp_path, trials=[long, {**long, "checkpoint.keep_last": 3}])
    out = tmp_path / "out"
    victim, ref = sweep.load(path, out).trials
    command = [sys.executable, "-m", "qwenkit.cli", "sweep", "run", str(path), "--out", str(out)]
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _until(first, lambda: (victim.output_dir / "checkpoints" / "step-00000002" / "COMPLETE.json").is_file(), "step 2")
    _kill(first, rank_only=True)
    text = first.communicate(timeout=600)[0]
    assert first.returncode == 1, text
    rows = ledger.latest(out)
    assert [r["status"] for r in rows.values()] == ["failed", "done"]
    failed = rows[victim.name]
    assert failed["exit_code"] == 128 + signal.SIGKILL
    assert failed["error"].startswith("qwenkit train: rank 0 (pid ") and "failed first: killed by SIGKILL" in failed["error"]
    assert events.last(events.read(victim.output_dir), "failed")["by"] == "launcher"
    m = rows[ref.name]["metrics"]  # the trial after the failed one finished, with its summary numbers
    assert m["steps"] == 16 and m["loss"] == metrics.series(metrics.read(ref.output_dir), "loss")[16]
    assert m["eval_loss"] > 0 and 0 <= m["eval_accuracy"] <= 1 and m["tokens_per_s"] > 0
    assert m["trainable_params"] > 0 and m["peak_memory"] > 0 and m["wall_time"] > 0
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("[")] == [
        f"[1/2] {victim.name}", f"[2/2] {ref.name}"]  # fmt: skip
    assert sweep.status_command(str(out)) == 0
    table = capsys.readouterr().out
    assert "failed" in table and "killed by SIGKILL" in table

    second = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def saved_after_resuming() -> bool:
        seen = events.read(victim.output_dir)
        at = max((i for i, e in enumerate(seen) if e["event"] == "resumed"), default=None)
        return at is not None and any(e["event"] == "checkpoint" for e in seen[at:])

    _until(second, saved_after_resuming, "checkpoint after resuming")
    _kill(second)
    second.wait()
    assert ledger.latest(out)[victim.name]["status"] == "running"
    steps_before = max(metrics.series(metrics.read(victim.output_dir), "loss"))
    assert steps_before < 16, "the trial finished before the sweep was killed"

    again = run_qwenkit("sweep", "run", str(path), "--out", str(out))
    assert again.returncode == 0, again.stdout + again.stderr
    rows = ledger.latest(out)
    assert [r["status"] for r in rows.values()] == ["done", "done"]
    assert rows[ref.name]["attempt"] == 1 and "done earlier" in again.stdout  # skipped, not run again
    assert (ref.output_dir / "train.log").read_text().count("starting fresh") == 1
    resumed = rows[victim.name]
    assert resumed["attempt"] == 3 and 4 <= resumed["resumed_from"] <= steps_before
    assert f"resumed from step {resumed['resumed_from']}" in again.stdout
    want = metrics.series(metrics.read(ref.output_dir), "loss")
    got = metrics.series(metrics.read(victim.output_dir), "loss")  # a step logged twice keeps its last row
    assert sorted(got) == sorted(want) == list(range(1, 17))
    assert max(abs(got[k] - want[k]) for k in want) <= 1e-6  # DCP resume on one CPU rank: identical in fp32
    assert metrics.series(metrics.read(victim.output_dir), "eval_loss") == pytest.approx(
        metrics.series(metrics.read(ref.output_dir), "eval_loss"), abs=1e-6)  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed (the mlflow extra)")
@pytest.mark.long
def test_mlflow_runs_hold_the_same_metrics_as_the_jsonl(tmp_path):
    import mlflow

    path = write_sweep(tmp_path, grid={"train.lr": [0.003, 0.001]}, overrides=[*SMALL, "train.report_to=[mlflow]"],
                  name="mlflow-check")  # fmt: skip
    out = tmp_path / "out"
    proc = run_qwenkit("sweep", "run", str(path), "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("mlflow-check")  # one experiment per sweep
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {"lr0.003", "lr0.001"}  # one MLflow run per trial
    for name, run in runs.items():
        rows = metrics.read(out / name)
        assert run.data.params["train.lr"] == str(float(name[2:])) and run.info.status == "FINISHED"
        for metric in metrics.UNITS:
            want = metrics.series(rows, metric)
            got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, metric)}
            assert got == pytest.approx(want, rel=0, abs=0), metric


@pytest.mark.slow
@pytest.mark.skipif(bool(why := families.get("qwen3_5").unavailable()), reason=why or "")
def test_a_sweep_over_the_family_trains_each_and_notebook_05_compares_them(tmp_path):
    """``model.name`` as a sweep key (issue 42: sweeps and notebooks with the Qwen3.5 family): each
    trial trains its family's tiny model (its own checkpoint and data index), and notebook 05's
    computations rank them with the family as the varied key."""
    path = write_sweep(tmp_path, grid={"model.name": ["qwen2_5_vl", "qwen3_5"]}, overrides=[*SMALL, "train.steps=2"])
    out = tmp_path / "out"
    rows = sweep.run(sweep.load(path, out))
    assert [r["status"] for r in rows] == ["done", "done"], rows
    folders = compare.run_folders(out)
    runs = compare.collect(folders, out)
    assert [r["varied"] for r in runs] == [{"model.name": "qwen2_5_vl"}, {"model.name": "qwen3_5"}]
    params = {r["varied"]["model.name"]: r["final"]["trainable_params"] for r in runs}
    assert params["qwen2_5_vl"] != params["qwen3_5"] > 0  # two different models trained
    values = compare.save(tmp_path / "report", runs, "loss")
    assert values["varied"] == ["model.name"] and values["done"] == 2 and all(r["final"]["steps"] == 2 for r in runs)
    assert len(compare.figures(tmp_path / "report")) >= 3
