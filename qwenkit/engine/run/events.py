"""A run's event stream, ``<output_dir>/events.jsonl``: what other programs learn about a run.

The trainer writes it; the sweep, the notebooks and the tests read it here (:func:`read`,
:class:`Follower`), never the console lines, which are for people and may change wording. One
JSON object per line, appended by every invocation of the run (a resumed run continues the file)::

    {"event": "started", "time": "2026-12-01T12:00:00.123+00:00", "rank": 0, "world_size": 2, "steps": 30}
    {"event": "resumed", ..., "step": 10, "checkpoint": "/runs/x/checkpoints/step-00000010"}
    {"event": "step", ..., "step": 11, "steps": 30, "loss": 5.91, "grad_norm": 1.2, "lr": 0.001,
     "tokens_per_s": 812.0, "step_time": 0.4}
    {"event": "eval", ..., "step": 20, "eval_loss": 5.2, "eval_accuracy": 0.25}
    {"event": "checkpoint", ..., "step": 20, "path": "/runs/x/checkpoints/step-00000020"}
    {"event": "stopped", ..., "step": 30, "reason": "completed", "exit_code": 0}
    {"event": "failed", ..., "rank": 1, "by": "rank", "error": "ValueError", "message": "...",
     "summary": "qwenkit train: rank 1 failed: ..."}
    {"event": "failed", ..., "rank": 0, "by": "rank", "error": "BadRows", "input": true, "message": "...",
     "summary": "qwenkit train: 6 of 6 samples ... (rank 0; its traceback: ...)"}
    {"event": "failed", ..., "rank": 0, "by": "launcher", "error": "killed", "signal": "SIGKILL",
     "exit_code": 137, "message": "killed by SIGKILL ...", "summary": "qwenkit train: rank 0 (pid 7) failed first: ..."}

Rank 0 writes every event but ``failed``. A rank that raises writes its own ``failed`` (``by:
rank``). The launcher side writes one (``by: launcher``, with ``exit_code`` and ``signal``) for a
failure no rank recorded, so that every failed invocation ends with one:

- ``refused``: ``qwenkit train`` refused the run before torchrun started (``rank`` null; only
  into a folder that exists: a refused new run leaves no folder behind; a folder another live
  job holds is that job's and gets nothing);
- ``killed`` / ``exited``: the rank torchrun saw fail first died by a signal (SIGKILL: a
  person, the scheduler or the kernel's out-of-memory killer) or exited non-zero without
  reporting a Python exception (:mod:`qwenkit.torchrun` writes it);
- ``stopped``: a stop signal ended the ranks before every one saved;
- a torchrun exception's name (a rendezvous that failed), or ``torchrun``: torchrun itself ended
  non-zero (killed, bad arguments) without naming a rank.

``step`` comes at the
trainer's step-line cadence (``train.log_every`` and the invocation's last step). ``stopped``'s
``reason``: ``completed`` (``train.steps`` reached), ``stop_after`` (``train.stop_after``
reached; exit 75), ``signal`` (with ``signal``: the stop signal's name; exit 75). A crashed
writer may leave a cut last line: readers skip it, and the next writer starts on a new line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qwenkit import records
from qwenkit.rundir import RunDir

KINDS = ("started", "resumed", "step", "eval", "checkpoint", "stopped", "failed")


class EventLog:
    """The writer of one rank: ``write(kind, **fields)`` appends a line (flushed); a disabled log writes nothing."""

    def __init__(self, output_dir: str | Path, rank: int, enabled: bool = True):
        self.path, self.rank, self.enabled = RunDir(output_dir).events, rank, enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("ab+") as f:  # a line cut by a crash ends here: the next event starts a line
                if f.tell() and (f.seek(-1, 2), f.read(1))[1] != b"\n":
                    f.write(b"\n")

    def write(self, kind: str, **fields: Any) -> None:
        if kind not in KINDS:
            raise ValueError(f"event kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if self.enabled:
            records.append_jsonl(self.path, {"event": kind, "time": records.now(), "rank": self.rank, **fields})

    def failed(self, error: BaseException, summary: str, user_input: bool = False) -> None:
        """This rank's own failure: the exception it raised; ``user_input``: the user's to fix and said in
        one line (:func:`qwenkit.engine.run.rank.one_line`: a bad row, a reward's value, a full disk, an
        engine's known error): the summary is the one line people read (:func:`input_failure`), and a
        restart of the group would meet it again."""
        extra = {"input": True} if user_input else {}
        self.write("failed", by="rank", error=type(error).__name__, message=first_line(error), summary=summary, **extra)


def first_line(error: BaseException | str) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def launcher_failed(output_dir: str | Path, summary: str, *, error: str, message: str, exit_code: int,
                    rank: int | None = None, signal: str | None = None) -> bool:  # fmt: skip
    """The launcher's ``failed`` event, for a failure no rank recorded (see the module docstring).
    Written only into a folder that exists; False when nothing was written (no folder, or a full
    disk: then the console line is all there is)."""
    if not Path(output_dir).is_dir():
        return False
    try:
        EventLog(output_dir, rank).write("failed", by="launcher", error=error, message=message, exit_code=exit_code,
                                         signal=signal, summary=summary)  # fmt: skip
    except OSError:
        return False
    return True


def failed(events: list[dict[str, Any]], rank: int | None = None) -> bool:
    """Whether ``events`` hold a ``failed`` event (of ``rank``'s own, when given)."""
    return any(e.get("event") == "failed" and (rank is None or (e.get("rank") == rank and e.get("by") != "launcher"))
               for e in events)  # fmt: skip


def input_failure(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ``failed`` event of an input error a rank recorded (rank 0's first, which its console said), or None."""
    found = [e for e in events if e.get("event") == "failed" and e.get("input")]
    return min(found, key=lambda e: e.get("rank") != 0) if found else None


def read(output_dir: str | Path) -> list[dict[str, Any]]:
    """Every event of a run folder, in file order (none when the run wrote none)."""
    path = RunDir(output_dir).events
    return records.read_jsonl(path, skip_bad=True) if path.is_file() else []


class Follower:
    """The events a run appends from now on: each :meth:`poll` returns the complete lines written
    since the last (a line still being written waits for the next poll)."""

    def __init__(self, output_dir: str | Path):
        self.path = RunDir(output_dir).events
        self.offset = self.path.stat().st_size if self.path.is_file() else 0
        self.seen: list[dict[str, Any]] = []  # every event polled so far

    def poll(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        new = records.parse_jsonl(chunk[:end].decode(), str(self.path), skip_bad=True)
        self.seen += new
        return new


def last(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in reversed(events) if e.get("event") == kind), None)


def resumed_step(events: list[dict[str, Any]]) -> int | None:
    """The checkpoint step the (last) invocation among ``events`` resumed from; None: it started fresh."""
    e = last(events, "resumed")
    return None if e is None else e["step"]


def failure(events: list[dict[str, Any]]) -> str | None:
    """The one-line report of why ``events``' invocation failed (None: nothing recorded one): the
    launcher's, when it wrote one (it names the rank torchrun saw fail first, which a peer's
    later connection error must not hide), else the first failing rank's own."""
    reports = [e for e in events if e.get("event") == "failed"]
    verdict = next((e for e in reports if e.get("by") == "launcher"), reports[0] if reports else None)
    return None if verdict is None else verdict["summary"]


def describe(event: dict[str, Any]) -> str:
    """One line for people (the notebooks' progress), e.g. ``step 3/30  loss 5.9100  812 tok/s``."""
    kind = event.get("event")
    if kind == "step":
        return f"step {event['step']}/{event['steps']}  loss {event['loss']:.4f}  {event['tokens_per_s']:.0f} tok/s"
    if kind == "resumed":
        return f"resumed from {event['checkpoint']} at step {event['step']}"
    if kind == "checkpoint":
        return f"checkpoint saved: {event['path']}"
    if kind == "eval":
        shown = {k: v for k, v in event.items() if k.startswith("eval_")}
        return f"eval at step {event['step']}: " + "  ".join(f"{k} {v:.4f}" for k, v in shown.items())
    if kind == "started":
        return f"started: {event['world_size']} rank(s), train.steps={event['steps']}"
    if kind == "stopped":
        why = event["reason"] + (f" ({event['signal']})" if event.get("signal") else "")
        return f"stopped at step {event['step']}: {why}, exit code {event['exit_code']}"
    if kind == "failed":
        return event["summary"]
    return str(event)
