"""Training progress in a notebook: live bars in JupyterLab, a collapsed log in a rendered report.

A run logs one line per step; a report that showed them all would open on screens of log
before its first figure. :class:`RunLog` takes a run's lines and events (``runs.train``'s ``echo``)
and, live in JupyterLab, draws a ``tqdm.notebook`` bar per run from its step events (step, loss,
tokens/s, ETA; :mod:`qwenkit.engine.run.events`) and :class:`LiveCurves`, the loss and tokens/s
curves redrawn in place as the run's ``events.jsonl`` grows;
in a batch report (``qwenkit notebooks run`` sets :data:`REPORT_ENV`) it shows nothing while
the run goes, and :meth:`RunLog.show` puts the log in a ``<details>`` block holding its first
and last lines, below the summary the notebook displays first. :class:`SweepLog` does the same
for each trial of ``qwenkit.sweep.run`` (its ``progress`` argument), with one result line per trial
(:func:`qwenkit.sweep.ledger.result_text`, the terminal's line).
"""

from __future__ import annotations

import html
import math
import os
import time
from typing import Any

from IPython.display import HTML, display

from qwenkit.notebooks import plots
from qwenkit.sweep.ledger import result_text

REPORT_ENV = "QWENKIT_REPORT"  # set by the runner: the kernel renders a report, nobody watches it live
HEAD, TAIL = 4, 6  # log lines a report shows before and after the collapsed middle


def live() -> bool:
    """True in JupyterLab (bars drawn as the run goes), False when the runner renders a report."""
    return os.environ.get(REPORT_ENV) != "1"


def details_html(title: str, lines: list[str]) -> str:
    """A closed ``<details>`` block: the first and last lines of a log, the count of those left out."""
    if len(lines) > HEAD + TAIL:
        shown = [*lines[:HEAD], f"... {len(lines) - HEAD - TAIL} more lines ...", *lines[-TAIL:]]
    else:
        shown = lines
    body = html.escape("\n".join(shown))
    return (f'<details class="run-log"><summary>{html.escape(title)} ({len(lines)} lines)</summary>'
            f'<pre style="font-size:0.85em;white-space:pre-wrap">{body}</pre></details>')  # fmt: skip


class _Bar:
    """One tqdm.notebook bar fed by step events (created at the first one, which gives the total)."""

    def __init__(self, label: str):
        self.label, self.bar = label, None

    def feed(self, event: dict[str, Any]) -> None:
        if event["event"] != "step":
            return
        step, total = event["step"], event["steps"]
        if self.bar is None:
            from tqdm.notebook import tqdm

            self.bar = tqdm(total=total, initial=step - 1, desc=self.label)
        self.bar.n = step
        self.bar.set_postfix_str(f"loss {event['loss']:.4f}, {event['tokens_per_s']:.0f} tok/s", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class LiveCurves:
    """A run's loss and tokens/s while it trains, from its step events (``runs.train`` follows the
    run's ``events.jsonl`` with :class:`qwenkit.engine.run.events.Follower`): one figure, displayed at
    the first step and updated in place, at most every ``every_s`` seconds and at :meth:`close`."""

    def __init__(self, title: str, every_s: float = 1.0):
        self.title, self.every_s = title, every_s
        self.steps: dict[int, tuple[float, float]] = {}  # step -> (loss, tokens/s); a re-logged step: the last
        self._handle = None
        self._drawn_at, self._drawn = -math.inf, 0

    def feed(self, event: dict[str, Any]) -> None:
        if event.get("event") != "step":
            return
        self.steps[event["step"]] = (event["loss"], event["tokens_per_s"])
        if time.monotonic() - self._drawn_at >= self.every_s:
            self.draw()

    def figure(self):
        steps = sorted(self.steps)
        return plots.live_progress(steps, [self.steps[s][0] for s in steps], [self.steps[s][1] for s in steps],
                                   f"{self.title}: step {steps[-1] if steps else 0}")  # fmt: skip

    def draw(self) -> None:
        if self._handle is None:
            self._handle = display(self.figure(), display_id=True)
        else:
            self._handle.update(self.figure())
        self._drawn_at, self._drawn = time.monotonic(), len(self.steps)

    def close(self) -> None:
        if self.steps and self._drawn != len(self.steps):
            self.draw()


class RunLog:
    """``echo`` for ``runs.train``: every line kept; a live bar and :class:`LiveCurves` from the
    run's events in JupyterLab (:meth:`event`); :meth:`show` the log."""

    def __init__(self, label: str, interactive: bool | None = None):
        self.label = label
        self.interactive = live() if interactive is None else interactive
        self.lines: list[str] = []
        self._bar = _Bar(label) if self.interactive else None
        self._curves = LiveCurves(label) if self.interactive else None

    def __call__(self, line: str) -> None:
        self.lines.append(line)

    def event(self, event: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.feed(event)
            self._curves.feed(event)

    def show(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._curves.close()
        display(HTML(details_html(f"log of {self.label}", self.lines)))


class SweepLog:
    """``progress`` for ``qwenkit.sweep.run``: a bar per trial in JupyterLab; each trial's result
    line and collapsed log in a report (:meth:`show`)."""

    def __init__(self, interactive: bool | None = None):
        self.interactive = live() if interactive is None else interactive
        self.logs: dict[str, list[str]] = {}
        self.results: dict[str, str] = {}
        self._bars: dict[str, _Bar] = {}

    def start(self, trial, note: str) -> None:
        self.logs.setdefault(trial.name, []).append(f"-- {note} {trial.name}")
        if self.interactive:
            self._bars[trial.name] = _Bar(f"{trial.index}. {trial.name}")

    def event(self, trial, event: dict[str, Any]) -> None:
        if trial.name in self._bars:
            self._bars[trial.name].feed(event)

    def line(self, trial, text: str) -> None:
        self.logs.setdefault(trial.name, []).append(text)

    def end(self, trial, row: dict[str, Any]) -> None:
        if trial.name in self._bars:
            self._bars.pop(trial.name).close()
        text = result_text(row)  # the terminal's line too (qwenkit.sweep.ledger)
        self.results[trial.name] = text
        if self.interactive:
            print(f"{trial.index}. {trial.name}: {text}")

    def show(self) -> None:
        items = "".join(f"<li><code>{html.escape(n)}</code>: {html.escape(t)}</li>" for n, t in self.results.items())
        logs = "".join(details_html(f"log of {name}", lines) for name, lines in self.logs.items())
        display(HTML(f"<ul>{items}</ul>{logs}"))
