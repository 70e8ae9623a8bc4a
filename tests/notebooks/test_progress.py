"""Progress in notebooks: a live bar per run in JupyterLab, a collapsed log (first and last lines) in a report."""

from __future__ import annotations

from qwenkit.engine import events
from qwenkit.notebooks import progress

STEPS = [{"event": "step", "step": i, "steps": 20, "loss": 6 - i / 10, "tokens_per_s": 1000.0 + i} for i in range(1, 21)]
LINES = ["$ qwenkit train ...", "no checkpoint to resume from", *map(events.describe, STEPS), "-- finished after 9 s"]


def test_details_keeps_the_first_and_last_lines():
    page = progress.details_html("log of x", LINES)
    assert page.startswith('<details class="run-log"><summary>log of x (23 lines)</summary>')
    assert "step 1/20" in page and "step 2/20" in page and "step 16/20" in page and "finished after" in page
    assert "step 3/20" not in page and "step 15/20" not in page and "... 13 more lines ..." in page
    assert "more lines" not in progress.details_html("short", LINES[:5])


def test_live_bar_follows_the_step_lines(monkeypatch):
    shown = []
    monkeypatch.setattr(progress, "display", shown.append)
    log = progress.RunLog("run a", interactive=True)
    for line in LINES[:12]:
        log(line)
    for event in [{"event": "started", "world_size": 1, "steps": 20}, *STEPS[:10]]:
        log.event(event)
    bar = log._bar.bar
    assert (bar.n, bar.total) == (10, 20) and "loss 5.0000, 1010 tok/s" in bar.postfix
    log.show()
    assert log.lines == LINES[:12] and 'class="run-log"' in shown[-1].data


def test_a_report_draws_no_bar(monkeypatch):
    monkeypatch.setenv(progress.REPORT_ENV, "1")
    log = progress.RunLog("run a")
    log(LINES[2])
    assert not progress.live() and log._bar is None and log.lines == [LINES[2]]
