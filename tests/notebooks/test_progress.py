"""Progress in notebooks: a live bar per run in JupyterLab, a collapsed log (first and last lines) in a report."""

from __future__ import annotations

import json

from qwenkit.engine.run import events
from qwenkit.notebooks import progress
from qwenkit.rundir import RunDir

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
    monkeypatch.setattr(progress, "display", lambda obj, display_id=False: shown.append(obj) or _Handle(shown))
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


class _Handle:
    def __init__(self, shown: list):
        self.shown = shown

    def update(self, obj) -> None:
        self.shown.append(("update", obj))


def _x(fig) -> list[int]:
    return list(fig.data[0].x)


def test_live_curves_redraw_in_place_as_events_jsonl_grows(monkeypatch, tmp_path):
    """The run's events.jsonl grows while it trains: each poll's complete lines (a half-written one
    waits) extend the loss and tokens/s curves of one figure, displayed once and updated in place."""
    shown = []

    def fake_display(obj, display_id=False):
        assert display_id is True  # a handle to update, not a new output per step
        shown.append(("display", obj))
        return _Handle(shown)

    monkeypatch.setattr(progress, "display", fake_display)
    path = RunDir(tmp_path).events
    path.parent.mkdir(parents=True, exist_ok=True)
    follower = events.Follower(tmp_path)
    curves = progress.LiveCurves("run a", every_s=0)
    lines = [json.dumps(e) + "\n" for e in [{"event": "started", "world_size": 2, "steps": 20}, *STEPS[:5]]]
    with path.open("a") as f:
        f.write("".join(lines[:3]) + lines[3][:10])  # started, steps 1-2, half of step 3
        f.flush()
        for event in follower.poll():
            curves.feed(event)
        assert [kind for kind, _ in shown] == ["display", "update"] and _x(shown[-1][1]) == [1, 2]
        f.write(lines[3][10:] + "".join(lines[4:]))
        f.flush()
        for event in follower.poll():
            curves.feed(event)
    fig = shown[-1][1]
    assert [kind for kind, _ in shown] == ["display"] + ["update"] * 4
    assert _x(fig) == [1, 2, 3, 4, 5] and list(fig.data[0].y) == [s["loss"] for s in STEPS[:5]]
    assert list(fig.data[1].y) == [s["tokens_per_s"] for s in STEPS[:5]]
    assert fig.layout.title.text == "run a: step 5"


def test_live_curves_draw_at_most_every_interval_and_once_more_at_the_end(monkeypatch):
    shown = []
    monkeypatch.setattr(progress, "display", lambda obj, display_id=False: shown.append(obj) or _Handle(shown))
    curves = progress.LiveCurves("run a", every_s=3600)
    for event in STEPS[:10]:
        curves.feed(event)
    assert len(shown) == 1 and _x(shown[0]) == [1]  # the first step, then nothing for an hour
    curves.close()
    assert _x(shown[-1][1]) == list(range(1, 11))
