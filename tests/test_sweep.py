"""``qwenkit sweep``: the sweep file and its validation, device slots, and real sweeps of the tiny
model on one rank: a trial the launcher refuses, a trial whose rank is killed and then the sweep
killed in the middle, both resumed (the trial's losses against an uninterrupted trial of the same
training), and MLflow beside the JSONL. A rank's own failure report: tests/test_events.py."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from qwenkit import config as qconfig
from qwenkit import sweep
from qwenkit.engine import events, metrics
from qwenkit.sweep import ledger

ROOT = Path(__file__).resolve().parent.parent
# 1 rank, a few steps of 4 rows, a 4-row eval set (2 of them generated for accuracy)
SMALL = ["parallel.nproc=1", "train.steps=4", "train.micro_batch_size=4", "data.tiny_samples=16",
         "data.tiny_eval_samples=4", "train.eval_samples=2", "train.eval_every=0", "train.eval_accuracy_every=0",
         "checkpoint.every=0", "train.warmup_steps=1"]  # fmt: skip


def _write(tmp_path, **spec) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": str(ROOT / "params" / "tiny_cpu.yaml"), "overrides": SMALL, **spec}))
    return path


def _qwenkit(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "qwenkit.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The sweep file


def test_trials_are_override_sets_times_grid_times_seeds(tmp_path):
    s = sweep.load(_write(tmp_path, trials=[{"loss.chunk": True}, ["loss.chunk=false"]],
                          grid={"train.lr": [0.001, 0.003]}, seeds=[1, 2]), tmp_path / "out")  # fmt: skip
    assert len(s.trials) == 2 * 2 * 2
    assert [t.name for t in s.trials[:4]] == ["chunkTrue-lr0.001-seed1", "chunkTrue-lr0.001-seed2",
                                              "chunkTrue-lr0.003-seed1", "chunkTrue-lr0.003-seed2"]  # fmt: skip
    t = s.trials[5]
    assert t.varied == {"loss.chunk": False, "train.lr": 0.001, "train.seed": 2}
    assert (t.cfg.loss.chunk, t.cfg.train.lr, t.cfg.train.seed, t.cfg.train.steps) == (False, 0.001, 2, 4)
    assert t.output_dir == (tmp_path / "out" / t.name).resolve() and t.cfg.train.resume == "auto"
    assert s.varied_keys == ["loss.chunk", "train.lr", "train.seed"]


@pytest.mark.parametrize("value", [0.003, 1e-05, True, "x y", [1, 2], None])
def test_override_text_parses_back_to_the_value(value):
    key, text = sweep.override_text("a.b", value).split("=", 1)
    assert yaml.safe_load(text) == value


def test_sweep_files_are_read_as_configs_are(tmp_path):
    # YAML 1.1 (yaml.safe_load) reads `off` as False and `1e-4` as a string; the config loader does not
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {ROOT / 'params' / 'tiny_cpu.yaml'}\noverrides: [{', '.join(SMALL)}]\n"
                    "grid: {model.fused_ops: [off], train.lr: [1e-4]}\ntrials: [[train.warmup_steps=off]]\n")
    with pytest.raises(sweep.SweepError, match="train.warmup_steps"):  # an int field: `off` stays a string
        sweep.load(path, tmp_path / "out")
    path.write_text(path.read_text().replace("trials: [[train.warmup_steps=off]]", "trials: [[loss.chunk=off]]"))
    (t,) = sweep.load(path, tmp_path / "out").trials
    assert (t.cfg.model.fused_ops, t.cfg.train.lr, t.cfg.loss.chunk) == ("off", 1e-4, False)
    assert t.varied == {"loss.chunk": "off", "model.fused_ops": "off", "train.lr": 1e-4}


def test_names_keep_keys_apart_when_their_last_parts_clash():
    assert sweep.trial_name({"train.lr": 0.003, "train.seed": 1}) == "lr0.003-seed1"
    assert sweep.trial_name({"a.r": 1, "b.r": 2}) == "a_r1-b_r2"
    assert sweep.trial_name({"model.freeze": ["model.visual"]}) == "freezemodel.visual"
    assert sweep.trial_name({}) == "base"


def test_a_bad_value_in_one_trial_fails_the_sweep_before_any_run(tmp_path, tiny_path):  # tiny_path: the checkpoint is written, its progress bar is not in stderr
    path = _write(tmp_path, trials=[{"train.lr": 0.001}, {"train.lr": 0.002}, {"train.warmup_steps": -1}])
    out = tmp_path / "out"
    proc = _qwenkit("sweep", "run", str(path), "--out", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "trial 3 (warmup_steps-1)" in lines[0] and "train.warmup_steps must be >= 0" in lines[0]
    assert not out.exists()  # nothing ran, nothing was written


def test_an_unknown_key_names_the_trial_and_the_key(tmp_path, tiny_path):
    with pytest.raises(sweep.SweepError, match=r"trial 2 \(lrr0.1\): unknown key 'train.lrr'; did you mean 'train.lr'"):
        sweep.load(_write(tmp_path, trials=[{"train.lr": 0.1}, {"train.lrr": 0.1}]), tmp_path / "out")
    with pytest.raises(sweep.SweepError, match="unknown key 'grids'"):
        sweep.load(_write(tmp_path, grids={"train.lr": [1]}), tmp_path / "out")
    with pytest.raises(sweep.SweepError, match="seeds must be a non-empty list of integers"):
        sweep.load(_write(tmp_path, seeds=["1"]), tmp_path / "out")
    with pytest.raises(sweep.SweepError, match="trials 1 and 2 are both 'lr0.1'"):
        sweep.load(_write(tmp_path, trials=[{"train.lr": 0.1}, {"train.lr": 0.1}]), tmp_path / "out")


def test_a_trial_folder_run_with_another_config_is_refused(tmp_path):
    s = sweep.load(_write(tmp_path, grid={"train.lr": [0.001]}), tmp_path / "out")
    qconfig.write_config(s.trials[0].cfg, s.trials[0].output_dir)
    sweep.load(_write(tmp_path, grid={"train.lr": [0.001]}), tmp_path / "out")  # the same config: fine
    with pytest.raises(sweep.SweepError, match="was run with another config"):
        sweep.load(_write(tmp_path, grid={"train.lr": [0.001]}, overrides=[*SMALL, "train.steps=5"]), tmp_path / "out")


def test_device_slots_split_the_visible_devices():
    assert sweep.device_slots("cuda", 2, 2, {}, 4) == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    env = {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}
    assert sweep.device_slots("npu", 4, 1, env, 8) == [{"ASCEND_RT_VISIBLE_DEVICES": d} for d in "4567"]
    assert sweep.device_slots("cpu", 2, 1, {}, 0) == [{}, {}]
    with pytest.raises(sweep.SweepError, match="needs 6 cuda devices, 4 visible"):
        sweep.device_slots("cuda", 3, 2, {}, 4)


def test_parallel_on_cpu_is_refused_unless_asked(tmp_path, tiny_path):
    # tiny_path: the tiny checkpoint already written (its first write draws a progress bar on stderr)
    proc = _qwenkit("sweep", "run", str(_write(tmp_path, grid={"train.lr": [0.001, 0.002]})), "--out",
                    str(tmp_path / "out"), "--parallel", "2")  # fmt: skip
    assert proc.returncode == 2 and "--cpu-parallel" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_terminal_progress_redraws_one_line_per_trial():
    import io

    trial = sweep.Trial(2, "lr0.003", {"train.lr": 0.003}, ["train.lr=0.003"], qconfig.Config())
    stream = io.StringIO()
    view = sweep.TerminalProgress(3, stream, live=True)
    view.start(trial, "starting")
    view.event(trial, {"event": "step", "step": 1, "steps": 4, "loss": 6.01, "tokens_per_s": 812.2})
    view.event(trial, {"event": "checkpoint", "step": 1, "path": "x"})  # not a step: no redraw
    view.event(trial, {"event": "step", "step": 2, "steps": 4, "loss": 5.9, "tokens_per_s": 830.0})
    view.end(trial, {"status": "done", "metrics": {"loss": 5.8, "wall_time": 12.0}})
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.count("\r") == 4  # one line, redrawn in place
    assert "[2/3] lr0.003: step 2/4  loss 5.9000  830 tok/s  ETA" in text
    assert text.rstrip().endswith("[2/3] lr0.003: done in 12 s: loss 5.8")
    quiet = io.StringIO()
    view = sweep.TerminalProgress(3, quiet, live=False)  # not a terminal: the result line only
    view.start(trial, "starting")
    view.event(trial, {"event": "step", "step": 1, "steps": 4, "loss": 6.01, "tokens_per_s": 812.2})
    view.end(trial, {"status": "failed", "exit_code": 1, "error": "boom", "metrics": {}})
    assert quiet.getvalue() == "[2/3] lr0.003: failed, exit code 1: boom\n"


def test_report_to_mlflow_is_refused_when_mlflow_is_missing(monkeypatch):
    if importlib.util.find_spec("mlflow") is not None:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(qconfig.ConfigError, match="train.report_to: mlflow needs the mlflow package"):
        qconfig.load(overrides=["train.report_to=[mlflow]"])


def test_status_of_a_folder_without_a_ledger_is_a_user_error(tmp_path):
    proc = _qwenkit("sweep", "status", str(tmp_path))
    assert proc.returncode == 2 and "sweep.jsonl does not exist" in proc.stderr


# ---------------------------------------------------------------------------------------------
# Real sweeps


@pytest.mark.slow
def test_a_trial_the_launcher_refuses_is_recorded_with_its_reason(tmp_path, capsys):
    # the data file is there when the sweep checks its trials and gone when the trial starts
    data = tmp_path / "rows.jsonl"
    data.write_text("")
    s = sweep.load(_write(tmp_path, trials=[{"data.path": str(data)}]), tmp_path / "out")
    data.unlink()
    (row,) = sweep.run(s)
    assert (row["status"], row["exit_code"]) == ("failed", 2)
    assert row["error"] == f"qwenkit train: invalid run: data.path={str(data)!r} does not exist"  # the launcher's event
    assert capsys.readouterr().out.rstrip().endswith(f"failed, exit code 2: {row['error']}")


@pytest.mark.slow
@pytest.mark.long
def test_parallel_trials_on_cpu_when_asked(tmp_path):
    path = _write(tmp_path, grid={"train.lr": [0.003, 0.001]})
    out = tmp_path / "out"
    proc = _qwenkit("sweep", "run", str(path), "--out", str(out), "--parallel", "2", "--cpu-parallel")
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
            if not rank_only or ("qwenkit.engine.rank" in argv and "qwenkit.torchrun" not in argv):
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
    path = _write(tmp_path, trials=[long, {**long, "checkpoint.keep_last": 3}])
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

    again = _qwenkit("sweep", "run", str(path), "--out", str(out))
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

    path = _write(tmp_path, grid={"train.lr": [0.003, 0.001]}, overrides=[*SMALL, "train.report_to=[mlflow]"],
                  name="mlflow-check")  # fmt: skip
    out = tmp_path / "out"
    proc = _qwenkit("sweep", "run", str(path), "--out", str(out))
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
