"""qwenkit.sweep.progress: the terminal's one line per trial, redrawn in place (a result line when not a terminal)."""

from __future__ import annotations

from qwenkit import config as qconfig
from qwenkit import sweep


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
