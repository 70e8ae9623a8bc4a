"""``qwenkit sweep``: many training runs from one file, each a normal ``qwenkit train`` run, kept in a ledger.

A sweep file (``params/sweeps/<name>.yaml``)::

    base: params/tiny_cpu.yaml          # the run config every trial starts from
    overrides: [train.steps=40]         # applied to every trial
    grid: {train.lr: [0.001, 0.003]}    # every combination is a trial
    trials: [{loss.chunk: false}]       # and/or an explicit list of override sets (crossed with the grid)
    seeds: [1, 2]                       # each trial repeated with train.seed set
    name: lr                            # optional: the sweep's name (default: the file's stem)

Trials are ``trials x grid x seeds`` (a missing part counts as one empty set), named from what
they vary (``lr0.003-seed1``), and run in ``<sweep dir>/<trial>/`` by the launcher of
``qwenkit train`` (a child ``python -m qwenkit.cli train``), with ``train.resume=auto``. Every
trial's config goes through ``config.load`` and the launcher's pre-spawn checks before the first
trial starts: a bad value in trial 7 fails the sweep at once, naming the trial and the key.

``<sweep dir>/sweep.jsonl`` (:mod:`qwenkit.engine.ledger`) records each trial's state. Running
the same command again skips ``done`` trials and re-runs the others: an interrupted trial (the
sweep was killed) resumes from its newest checkpoint, a failed one starts again from its own.
A trial folder whose ``config.yaml`` differs from what the sweep file now asks for is refused.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import queue
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from qwenkit import config as qconfig
from qwenkit.device import resolve_device
from qwenkit.engine import events, ledger
from qwenkit.engine.child import TrainProcess
from qwenkit.launch import check_before_spawn

KEYS = ("base", "overrides", "grid", "trials", "seeds", "name")
VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
# A failure no rank recorded (the launcher refused the run, torchrun saw a rank die): the ledger's
# error is the first console line that reads like one, for the person reading the ledger.
ERROR_LINE = re.compile(r"failed: |invalid run|Error|error:")


class SweepError(ValueError):
    """A sweep file or folder that cannot run; the message is one line for the user."""


@dataclass
class Trial:
    index: int  # 1-based, in the sweep file's order
    name: str
    varied: dict[str, Any]  # the keys this trial sets beyond the common overrides (seed included)
    overrides: list[str]  # every override of the trial (common first), as key=value
    cfg: qconfig.Config  # resolved and validated
    first_step: int = 0  # the step the running attempt started from (a resumed trial's ETA)

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.train.output_dir)


@dataclass
class Sweep:
    file: Path
    name: str
    base: Path | None
    out_dir: Path
    trials: list[Trial] = field(default_factory=list)

    @property
    def varied_keys(self) -> list[str]:
        return list(dict.fromkeys(k for t in self.trials for k in t.varied))


# ---------------------------------------------------------------------------------------------
# The sweep file


def override_text(key: str, value: Any) -> str:
    """``key=value`` that ``config.load`` parses back to ``value`` (YAML flow style, one line)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    text = text.removesuffix("...").strip()
    return f"{key}={text}"


def trial_name(varied: dict[str, Any]) -> str:
    """``lr0.003-seed1`` from ``{train.lr: 0.003, train.seed: 1}``: each key's last part and its
    value (the whole key where two keys end alike); ``base`` when nothing varies."""
    lasts = [k.split(".")[-1] for k in varied]
    parts = []
    for key, last in zip(varied, lasts):
        label = last if lasts.count(last) == 1 else key.replace(".", "_")
        value = varied[key]
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        parts.append(label + re.sub(r"[^A-Za-z0-9.,+_-]", "_", text))
    return "-".join(parts) or "base"


def _resolve_base(base: str, file: Path) -> Path:
    """``base`` as given, else relative to the working directory, else to a folder above the sweep file."""
    p = Path(base).expanduser()
    if p.is_absolute() or p.is_file():
        return p.resolve()
    for d in file.resolve().parents:
        if (d / p).is_file():
            return (d / p).resolve()
    raise SweepError(f"{file}: base {base!r} does not exist (looked in {Path.cwd()} and above {file.parent})")


def _mapping_list(value: Any, where: str) -> list[dict[str, Any]]:
    """The ``trials`` list: each entry a mapping ``{key: value}`` or a list of ``key=value`` strings."""
    if not isinstance(value, list) or not value:
        raise SweepError(f"{where}: trials must be a non-empty list of override sets, got {value!r}")
    out = []
    for i, item in enumerate(value, 1):
        if isinstance(item, dict):
            out.append({str(k): v for k, v in item.items()})
        elif isinstance(item, list) and all(isinstance(s, str) and "=" in s for s in item):
            out.append({s.split("=", 1)[0].strip(): qconfig.parse_yaml(s.split("=", 1)[1]) for s in item})
        else:
            raise SweepError(f"{where}: trials[{i}] must be a mapping or a list of key=value, got {item!r}")
    return out


def load(file: str | Path, out_dir: str | Path | None = None) -> Sweep:
    """Read a sweep file, expand its trials and validate every one; raises :class:`SweepError`."""
    file = Path(file)
    if not file.is_file():
        raise SweepError(f"sweep file {str(file)!r} does not exist")
    try:
        raw = qconfig.parse_yaml(file.read_text(), str(file)) or {}  # YAML 1.2, as configs: `off` is a string
    except yaml.YAMLError as e:
        raise SweepError(f"{file}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise SweepError(f"{file}: top level must be a mapping of {', '.join(KEYS)}")
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        raise SweepError(f"{file}: unknown key {unknown[0]!r}; allowed: {', '.join(KEYS)}")
    name = str(raw.get("name") or file.stem)
    base = _resolve_base(raw["base"], file) if raw.get("base") else None
    common = raw.get("overrides") or []
    if not isinstance(common, list) or not all(isinstance(s, str) and "=" in s for s in common):
        raise SweepError(f"{file}: overrides must be a list of key=value strings, got {common!r}")
    grid = raw.get("grid") or {}
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise SweepError(f"{file}: grid must map keys to non-empty lists of values, got {grid!r}")
    explicit = _mapping_list(raw["trials"], str(file)) if raw.get("trials") is not None else [{}]
    seeds = raw.get("seeds")
    if seeds is not None and (not isinstance(seeds, list) or not seeds or
                              not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):  # fmt: skip
        raise SweepError(f"{file}: seeds must be a non-empty list of integers, got {seeds!r}")
    out = Path(out_dir or Path("runs") / "sweeps" / name).resolve()
    sweep = Sweep(file.resolve(), name, base, out)
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    for index, (ex, point, seed) in enumerate(itertools.product(explicit, points, seeds or [None]), 1):
        varied = {**ex, **point, **({"train.seed": seed} if seed is not None else {})}
        sweep.trials.append(_trial(sweep, index, varied, common))
    names = [t.name for t in sweep.trials]
    for t in sweep.trials:
        if names.count(t.name) > 1:
            twin = next(u for u in sweep.trials if u.name == t.name and u is not t)
            raise SweepError(f"{file}: trials {t.index} and {twin.index} are both {t.name!r} (the same overrides)")
    return sweep


def _trial(sweep: Sweep, index: int, varied: dict[str, Any], common: list[str]) -> Trial:
    name = trial_name(varied)
    # a key the trial varies replaces the common override of that key (no override given twice)
    common = [o for o in common if o.split("=", 1)[0].strip() not in varied]
    overrides = [*common, *(override_text(k, v) for k, v in varied.items())]
    where = f"trial {index} ({name})"
    try:
        cfg = qconfig.load(sweep.base, [*overrides, f"train.output_dir={sweep.out_dir / name}", "train.resume=auto"])
    except qconfig.ConfigError as e:
        raise SweepError(f"{sweep.file}: {where}: {'; '.join(e.problems)}") from None
    problems = check_before_spawn(cfg)
    if problems:
        raise SweepError(f"{sweep.file}: {where}: {'; '.join(problems)}")
    written = Path(cfg.train.output_dir) / "config.yaml"
    if written.is_file() and qconfig.parse_yaml(written.read_text(), str(written)) != cfg.to_dict():
        raise SweepError(f"{where}: {written} was run with another config than the sweep file now gives; "
                         "use another --out or remove that folder")  # fmt: skip
    return Trial(index, name, varied, overrides, cfg)


# ---------------------------------------------------------------------------------------------
# Devices


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


def _device_count(device: str) -> int:
    import torch

    return torch.cuda.device_count() if device == "cuda" else torch.npu.device_count() if device == "npu" else 0


# ---------------------------------------------------------------------------------------------
# Progress


class TerminalProgress:
    """One line per trial: redrawn in place on a terminal (step, loss, tokens/s, ETA) while the
    trial runs alone, then left as the trial's result; elsewhere only the result line."""

    def __init__(self, total: int, stream=None, live: bool | None = None):
        self.total, self.stream = total, stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.began: dict[str, float] = {}

    def start(self, trial: Trial, note: str) -> None:
        self.began[trial.name] = time.monotonic()
        if self.live:
            self._draw(f"[{trial.index}/{self.total}] {trial.name}: {note}")

    def event(self, trial: Trial, event: dict[str, Any]) -> None:
        """A step event of the trial's run (:mod:`qwenkit.engine.events`) redraws its line."""
        if not self.live or event["event"] != "step":
            return
        step, steps = event["step"], event["steps"]
        elapsed = time.monotonic() - self.began[trial.name]
        done = step - trial.first_step
        eta = f"{elapsed / done * (steps - step):.0f}s" if done > 0 else "?"
        self._draw(f"[{trial.index}/{self.total}] {trial.name}: step {step}/{steps}  loss {event['loss']:.4f}  "
                   f"{event['tokens_per_s']:.0f} tok/s  ETA {eta}")  # fmt: skip

    def line(self, trial: Trial, text: str) -> None:
        pass

    def end(self, trial: Trial, row: dict[str, Any]) -> None:
        text = f"[{trial.index}/{self.total}] {trial.name}: {result_text(row)}"
        if self.live:
            self._draw(text)
            self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _draw(self, text: str) -> None:
        self.stream.write("\r\x1b[2K" + text)
        self.stream.flush()


def result_text(row: dict[str, Any]) -> str:
    """``done in 31 s: loss 0.27, eval_loss 0.28, eval_accuracy 0.47`` (or the failure and its error)."""
    m = row.get("metrics") or {}
    wall = m.get("wall_time")
    head = f"{row['status']}" + (" earlier" if row.get("skipped") else "")
    head += f" in {wall:.0f} s" if isinstance(wall, (int, float)) else ""
    if row.get("resumed_from"):
        head += f" (resumed from step {row['resumed_from']})"
    if row["status"] != "done":
        return f"{head}, exit code {row.get('exit_code')}: {row.get('error') or ''}".rstrip(": ")
    shown = [f"{k} {m[k]:.4g}" for k in ("loss", "eval_loss", "eval_accuracy") if isinstance(m.get(k), (int, float))]
    return f"{head}: " + ", ".join(shown) if shown else head


# ---------------------------------------------------------------------------------------------
# Running


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
    slots = device_slots(device, parallel, nproc, env, _device_count(device) if parallel > 1 else 0)
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
    errors = []

    def line(text: str) -> None:
        if ERROR_LINE.search(text) and not text.startswith("qwenkit train: python"):
            errors.append(text.strip())
        queue_.put(("line", trial, text))

    code = proc.follow(line, lambda event: queue_.put(("event", trial, event)))
    wall = time.monotonic() - began + earlier_wall
    # the failing rank's own report (its event), else the first error-like line of the output
    error = events.failure(proc.events.seen) or (errors[0] if errors else None)
    resumed = events.resumed_step(proc.events.seen)
    status = "done" if code == 0 else "failed"
    final = ledger.final_metrics(trial.output_dir, wall) if code == 0 else {}
    row = {
        "trial": trial.name, "status": status, "overrides": trial.overrides, "varied": trial.varied,
        "start": start, "end": ledger.now(), "exit_code": code, "error": None if code == 0 else error or f"exit code {code}",
        "metrics": final, "attempt": attempt, "resumed_from": resumed, "output_dir": str(trial.output_dir),
        "wall_s": time.monotonic() - began,
    }  # fmt: skip
    queue_.put(("end", trial, (row, slot)))


# ---------------------------------------------------------------------------------------------
# The commands


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
