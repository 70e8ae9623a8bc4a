"""qwenkit.errors: an input error is one line naming the command and what to fix; with
``--traceback`` (QWENKIT_TRACEBACK=1) the traceback comes first, for a bug report."""

from __future__ import annotations

import pytest

from qwenkit import errors


def _raised() -> ValueError:
    try:
        raise ValueError("train.steps must be > 0, got 0")
    except ValueError as e:
        return e


def test_one_line_without_traceback(monkeypatch, capsys):
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    errors.print_user_error("train", _raised())
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "qwenkit train: train.steps must be > 0, got 0\n"


@pytest.mark.parametrize("value, shown", [("1", True), ("0", False), ("yes", False)])
def test_the_traceback_only_when_asked_and_the_line_last(monkeypatch, capsys, value, shown):
    monkeypatch.setenv(errors.TRACEBACK_ENV, value)
    errors.print_user_error("export", _raised())
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "qwenkit export: train.steps must be > 0, got 0"
    assert (lines[0] == "Traceback (most recent call last):") == shown
    assert any("in _raised" in line for line in lines) == shown
