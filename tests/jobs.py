"""Real ``qwenkit train`` jobs for the tests that signal, kill or restart them: start one, follow it
through its run folder, find its torchrun and rank processes (through ``/proc``).

What a test learns about a job's progress (its steps, what it resumed from, why it stopped) it
reads from the run's event stream through :mod:`qwenkit.engine.run.events`, as the sweep and the
notebooks do; the console is read only for the launcher's messages to people, which are what
such a test checks. Timeouts catch hangs, not slowness.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from multiproc import free_port, scaled

from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.run import events

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["data.tiny_samples=16", "data.tiny_eval_samples=0", "train.eval_samples=0", "train.warmup_steps=2"]
HANG = 240  # seconds: a test waiting longer than this has found a hang
STEPS = int(os.environ.get("QK_FAULTS_STEPS", 400))  # long enough to be signalled mid-run
EXIT_RESUMABLE = 75  # qwenkit.engine.EXIT_RESUMABLE, spelled out: a scheduler sees the number


def train_args(out, *overrides, nproc=2, steps=STEPS) -> list[str]:
    """``qwenkit train``'s arguments: the tiny model into ``out``, no periodic checkpoints, a port of its own."""
    return [
        "train", "--config", str(ROOT / "params" / "tiny_cpu.yaml"), "--nproc", str(nproc),
        "--master-port", str(free_port()), *SMALL, f"train.steps={steps}", "checkpoint.every=0",
        f"train.output_dir={out}", *overrides,
    ]  # fmt: skip


def train_cmd(out, *overrides, **kw) -> list[str]:
    """:func:`train_args` as a command line."""
    return [sys.executable, "-m", "qwenkit.cli", *train_args(out, *overrides, **kw)]


def train(out, *overrides, **kw) -> subprocess.CompletedProcess:
    """One ``qwenkit train`` to its end (see :func:`train_cmd`), its output captured."""
    return subprocess.run(train_cmd(out, *overrides, **kw), cwd=ROOT, capture_output=True, text=True, timeout=scaled(HANG))


def refused(out, *overrides, **kw) -> int:
    """The launcher of :func:`train`'s command in this process, for a refusal before spawn (no
    process start to pay): its exit status; the test fails if it would start torchrun. Its one line
    is in the test's ``capsys``."""
    import pytest

    from qwenkit import cli, launch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "spawn", lambda *a, **k: pytest.fail("the launcher started torchrun"))
        return cli.main(train_args(out, *overrides, **kw))


def invocation(out, before: int = 0) -> list[dict]:
    """The events of the last invocation into ``out`` that started after its first ``before`` events."""
    new = events.read(out)[before:]
    starts = [i for i, e in enumerate(new) if e["event"] == "started"]
    return new[starts[-1] :] if starts else []


def steps(evs: list[dict]) -> list[int]:
    return [e["step"] for e in evs if e["event"] == "step"]


class Job:
    """A ``qwenkit train`` in its own session, its output in files (read while it runs)."""

    def __init__(self, out: Path, *overrides, prefix=(), **kw):
        self.out = out
        self.stdout, self.stderr = Path(f"{out}.stdout"), Path(f"{out}.stderr")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.stdout, "w") as o, open(self.stderr, "w") as e:
            self.proc = subprocess.Popen(
                [*prefix, *train_cmd(out, *overrides, **kw)], cwd=ROOT, stdout=o, stderr=e, env=env,
                start_new_session=True,
            )  # fmt: skip

    def text(self, which="stdout") -> str:
        return (self.stdout if which == "stdout" else self.stderr).read_text()

    def _until(self, found, what: str, timeout: float):
        deadline = time.monotonic() + scaled(timeout)
        while time.monotonic() < deadline:
            got = found()
            if got:
                return got
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode} before {what}:\n{self.text('stderr')[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {scaled(timeout)} s:\n{self.text('stderr')[-3000:]}")

    def wait_for(self, pattern: str, which="stdout", timeout=HANG) -> re.Match:
        """A launcher message to people (one the event stream does not hold)."""
        return self._until(lambda: re.search(pattern, self.text(which), flags=re.M), repr(pattern), timeout)

    def wait_for_event(self, kind: str, step: int = 0, timeout=HANG) -> dict:
        """The first event of ``kind`` (at ``step`` or later, for events with a step) the run writes."""
        def found():
            return next((e for e in events.read(self.out) if e["event"] == kind and e.get("step", step) >= step), None)

        return self._until(found, f"{kind} event" + (f" at step >= {step}" if step else ""), timeout)

    def running(self, step: int = 2) -> tuple[dict[int, int], list[int]]:
        """Once the run has logged ``step``: its ranks' pids (rank -> pid) and torchrun's pid(s)."""
        self.wait_for_event("step", step)
        return rank_pids(self.proc.pid), children(self.proc.pid)

    def wait(self, timeout=HANG) -> int:
        try:
            return self.proc.wait(scaled(timeout))
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            raise

    def step(self) -> int:
        """The last step the run reported (its step events come every step: ``train.log_every=1``)."""
        done = steps(events.read(self.out))
        return done[-1] if done else 0


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def tree(pid: int) -> list[int]:
    out = []
    for child in children(pid):
        out += [child, *tree(child)]
    return out


def kill_tree(pid: int) -> None:
    for p in [pid, *tree(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def rank_pids(launcher: int, timeout=HANG) -> dict[int, int]:
    """rank -> pid of the ranks under ``launcher`` (launcher -> torchrun -> ranks)."""
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        ranks = {}
        for pid in tree(launcher):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"qwenkit.engine.run.rank" in cmdline:
                rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
                if rank is not None:
                    ranks[rank] = pid
        if len(ranks) == 2:
            return ranks
        time.sleep(0.2)
    raise AssertionError(f"ranks of {launcher} not found")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def gone(pids, timeout=HANG) -> bool:
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def checkpoints(out: Path) -> list[int]:
    """The steps of the complete checkpoints in run folder ``out``."""
    return [ckpt.step_of(p) for p in ckpt.complete_checkpoints(ckpt.checkpoint_root(out))]
