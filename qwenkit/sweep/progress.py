"""The terminal's view of a sweep: one line per trial, redrawn in place while it runs.

The scheduler (:func:`qwenkit.sweep.scheduler.run`) calls a progress object's ``start(trial, note)``,
``event(trial, event)`` (each event of the trial's run, :mod:`qwenkit.engine.run.events`),
``line(trial, text)`` (each console line) and ``end(trial, row)`` (its ledger row) from one thread;
:class:`qwenkit.notebooks.progress.SweepLog` is the notebooks' view.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from qwenkit.sweep.file import Trial
from qwenkit.sweep.ledger import result_text


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
        """A step event of the trial's run (:mod:`qwenkit.engine.run.events`) redraws its line."""
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
