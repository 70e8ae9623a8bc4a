"""Running a sweep: each trial a ``qwenkit train`` child process (:class:`qwenkit.engine.run.child.TrainProcess`)
on a device slot of its own, its state appended to the ledger, and the ``qwenkit sweep`` commands.

Trials run in ``<sweep dir>/<trial>/`` with ``train.resume=auto``. Running the same command again
skips ``done`` trials and re-runs the others: an interrupted trial (the sweep was killed) resumes
from its newest checkpoint, a failed one starts again from its own. What a trial did (resumed
from, the failing rank's report, its steps for the progress line) is read from its run's events.
"""

from __future__ import annotations

import fcntl
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from qwenkit.device import device_count, resolve_device
from qwenkit.engine.run import events, metrics
from qwenkit.engine.run.child import TrainProcess
from qwenkit.sweep import ledger
from qwenkit.sweep.file import Sweep, SweepError, Trial, load
from qwenkit.sweep.progress import TerminalProgress

VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def device_slots(device: str, parallel: int, nproc: int, env: dict[str, str], count: int) -> list[dict[str, str]]:
    """The environment of each of ``parallel`` concurrent trials: on CUDA/NPU each gets ``nproc``
    devices of its own (of those ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` already
    allows, else ``0..count-1``); on CPU they share the cores."""
    if parallel == 1 or device == "cpu":
        return [{} for _ in range(parallel)]
    var = VISIBLE_DEVICES[device]
    visible = [d for d in env.get(var, "").split(",") if d.strip()] or [str(i) for i in range(count)]
    if parallel * nproc > len(visible):
        raise SweepError(f"--parallel {parallel} with parallel.nproc={nproc} needs {parallel * nproc} {device} "
                         f"devices, {len(visible)} visible")  # fmt: skip
    return [{var: ",".join(visible[i * nproc:(i + 1) * nproc])} for i in range(parallel)]


def train_command(trial: Trial, base: Path | None) -> list[str]:
    config = ["--config", str(base)] if base else []
    return [sys.executable, "-m", "qwenkit.cli", "train", *config, *trial.overrides,
            f"train.output_dir={trial.output_dir}", "train.resume=auto"]  # fmt: skip


def _lock(out_dir: Path):
    """An exclusive lock on the sweep folder (released by the kernel if this process dies)."""
    f = (out_dir / ".sweep.lock").open("w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise SweepError(f"{out_dir}: another `qwenkit sweep run` is running in this folder") from None
    return f


def run(
    sweep: Sweep,
    parallel: int = 1,
    stop_on_failure: bool = False,
    cpu_parallel: bool = False,
    progress=None,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run every trial not yet ``done``; returns each trial's last ledger row, in the sweep's order.

    ``progress`` gets ``start/event/line/end`` calls from this thread (default: :class:`TerminalProgress`).
    """
    env = dict(os.environ if env is None else env)
    if parallel < 1:
        raise SweepError(f"--parallel must be >= 1, got {parallel}")
    device = resolve_device(sweep.trials[0].cfg.parallel.device)
    if device == "cpu" and parallel > 1 and not cpu_parallel:
        raise SweepError(f"--parallel {parallel} on CPU: trials would share this machine's {os.cpu_count()} cores "
                         "and distort each other's timings; add --cpu-parallel to do it anyway")  # fmt: skip
    nproc = max(t.cfg.parallel.nproc for t in sweep.trials)
    slots = device_slots(device, parallel, nproc, env, device_count(device) if parallel > 1 else 0)
    sweep.out_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock(sweep.out_dir)
    try:
        (sweep.out_dir / "sweep.yaml").write_text(sweep.file.read_text())  # what this folder was run from
        progress = progress or TerminalProgress(len(sweep.trials))
        before = ledger.latest(sweep.out_dir)
        todo = [t for t in sweep.trials if before.get(t.name, {}).get("status") != "done"]
        for t in sweep.trials:
            if t not in todo:
                progress.end(t, {**before[t.name], "skipped": True})
        _run_all(sweep, todo, slots, stop_on_failure, progress, env, before)
        after = ledger.latest(sweep.out_dir)
        return [after[t.name] for t in sweep.trials if t.name in after]
    finally:
        lock.close()


def _run_all(sweep, todo, slots, stop_on_failure, progress, env, before) -> None:
    """Start trials on free slots; every event comes back through one queue to this thread."""
    updates: queue.Queue = queue.Queue()
    history: dict[str, list[dict[str, Any]]] = {}
    for row in ledger.read(sweep.out_dir):
        history.setdefault(row["trial"], []).append(row)
    free = list(range(len(slots)))
    running: dict[str, TrainProcess] = {}
    pending = list(todo)
    stop = False
    try:
        while pending or running:
            while pending and free and not stop:
                trial, slot = pending.pop(0), free.pop(0)
                attempt = before.get(trial.name, {}).get("attempt", 0) + 1
                proc = _start(sweep, trial, {**env, **slots[slot]}, attempt)
                running[trial.name] = proc
                note = "resuming" if attempt > 1 else "starting"
                progress.start(trial, note)
                earlier = sum(r.get("wall_s") or 0.0 for r in history.get(trial.name, []))
                threading.Thread(target=_follow, args=(trial, proc, slot, attempt, earlier, updates), daemon=True).start()
            if not running:
                break
            kind, trial, payload = updates.get()
            if kind == "line":
                progress.line(trial, payload)
                continue
            if kind == "event":
                if payload["event"] == "resumed":
                    trial.first_step = payload["step"]
                progress.event(trial, payload)
                continue
            row, slot = payload
            running.pop(trial.name)
            free.append(slot)
            ledger.append(sweep.out_dir, row)
            progress.end(trial, row)
            if row["status"] == "failed" and stop_on_failure:
                stop = True
    except KeyboardInterrupt:
        for proc in running.values():
            proc.signal(signal.SIGTERM)
        for trial in todo:
            if trial.name in running:
                running[trial.name].wait()
                ledger.append(sweep.out_dir, {"trial": trial.name, "status": "interrupted", "overrides": trial.overrides,
                                              "varied": trial.varied, "end": ledger.now(), "exit_code": None,
                                              "error": "interrupted (Ctrl-C)", "metrics": {}})  # fmt: skip
        raise


def _start(sweep: Sweep, trial: Trial, env: dict[str, str], attempt: int) -> TrainProcess:
    env = {
        **env,
        # train.report_to: [mlflow] logs every trial of this sweep into one store and experiment
        "MLFLOW_TRACKING_URI": env.get("MLFLOW_TRACKING_URI", (sweep.out_dir / "mlruns").as_uri()),
        "MLFLOW_EXPERIMENT_NAME": env.get("MLFLOW_EXPERIMENT_NAME", sweep.name),
    }  # fmt: skip
    ledger.append(sweep.out_dir, {
        "trial": trial.name, "status": "running", "overrides": trial.overrides, "varied": trial.varied,
        "start": ledger.now(), "end": None, "exit_code": None, "error": None, "metrics": {}, "attempt": attempt,
        "output_dir": str(trial.output_dir),
    })  # fmt: skip
    trial.first_step = 0
    return TrainProcess(train_command(trial, sweep.base), trial.output_dir, env)


def _follow(trial: Trial, proc: TrainProcess, slot: int, attempt: int, earlier_wall: float,
            queue_: queue.Queue) -> None:  # fmt: skip
    """The trial's output lines and run events into the queue; then its ledger row (``wall_time``:
    this attempt's plus ``earlier_wall``, the attempts that ended before it)."""
    began, start = time.monotonic(), ledger.now()
    code = proc.follow(lambda text: queue_.put(("line", trial, text)), lambda event: queue_.put(("event", trial, event)))
    wall = time.monotonic() - began + earlier_wall
    # the failure's report from the run's events: a rank's own, or the launcher's for one no rank recorded
    error = events.failure(proc.events.seen) or f"exit code {code}; no failed event was recorded, see {proc.run_dir.train_log}"
    resumed = events.resumed_step(proc.events.seen)
    status = "done" if code == 0 else "failed"
    final = metrics.final_metrics(trial.output_dir, wall) if code == 0 else {}
    row = {
        "trial": trial.name, "status": status, "overrides": trial.overrides, "varied": trial.varied,
        "start": start, "end": ledger.now(), "exit_code": code, "error": None if code == 0 else error,
        "metrics": final, "attempt": attempt, "resumed_from": resumed, "output_dir": str(trial.output_dir),
        "wall_s": time.monotonic() - began,
    }  # fmt: skip
    queue_.put(("end", trial, (row, slot)))


def run_command(file: str, out: str | None, parallel: int, stop_on_failure: bool, cpu_parallel: bool) -> int:
    """``qwenkit sweep run``: 0 when every trial is done, 1 when one failed, 2 for a user error."""
    try:
        sweep = load(file, out)
        print(f"qwenkit sweep: {len(sweep.trials)} trials of {sweep.name} in {sweep.out_dir}", flush=True)
        rows = run(sweep, parallel, stop_on_failure, cpu_parallel)
    except SweepError as e:
        print(f"qwenkit sweep run: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qwenkit sweep run: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    done = sum(r["status"] == "done" for r in rows)
    print(f"qwenkit sweep: {done}/{len(sweep.trials)} trials done; ledger {sweep.out_dir / ledger.LEDGER}")
    return 0 if done == len(sweep.trials) else 1


def status_command(sweep_dir: str) -> int:
    """``qwenkit sweep status DIR``: the ledger as a table."""
    path = Path(sweep_dir)
    if not (path / ledger.LEDGER).is_file():
        print(f"qwenkit sweep status: {path / ledger.LEDGER} does not exist", file=sys.stderr)
        return 2
    print(ledger.format_table(ledger.table_rows(path)))
    return 0
