"""qwenkit.engine.run.rank: how a rank reports its failure. A bug: one line, then its traceback. An
input error (a bad row, too many bad rows, a reward that returns no number: what the user fixes in
their files): one line naming file/row or reward/row, on rank 0's console only (every rank reads the
same data), its traceback in the rank's log, on the console only with ``--traceback``."""

from __future__ import annotations

import pytest

from qwenkit.data.reader import DataError
from qwenkit.engine.generation.answers import UserFunctionError
from qwenkit.engine.run import rank
from qwenkit.errors import TRACEBACK_ENV


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as e:  # noqa: BLE001 - a raised exception, with its traceback
        return e


INPUT = {
    "rows": DataError("6 of 6 samples (100.0%) are bad, more than data.max_bad_fraction=0.01: bad_format 6; "
                      "first: dpo.jsonl: row 0 (line 1): bad_format: a preference row"),  # fmt: skip
    "reward": UserFunctionError("grpo.rewards 'none' returned None (NoneType) on row 3; it must return a float"),
}


@pytest.mark.parametrize("kind", INPUT)
def test_an_input_error_is_one_line_and_its_traceback_goes_to_the_log(kind, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    log = tmp_path / "rank-00000.log"
    error = _raised(INPUT[kind])
    rank.report_failure(0, error, log)
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"qwenkit train: {error} (rank 0; its traceback: {log})"], err
    assert "Traceback" in log.read_text() and str(error) in log.read_text()
    rank.report_failure(1, error, tmp_path / "rank-00001.log")  # the same rows on every rank: said once, by rank 0
    assert capsys.readouterr().err == "" and "Traceback" in (tmp_path / "rank-00001.log").read_text()
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    rank.report_failure(0, error, log)
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    error = _raised(RuntimeError("shape mismatch"))
    rank.report_failure(1, error, tmp_path / "rank-00001.log")
    err = capsys.readouterr().err
    assert err.startswith("qwenkit train: rank 1 failed: RuntimeError: shape mismatch (log: ") and "Traceback" in err
