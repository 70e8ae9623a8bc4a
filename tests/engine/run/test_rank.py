"""qwenkit.engine.run.rank: how a rank reports its failure. A bug: one line, then its traceback. An
input error (a bad row, too many bad rows, a reward that returns no number: what the user fixes in
their files): one line naming file/row or reward/row, on rank 0's console only (every rank reads the
same data), its traceback in the rank's log, on the console only with ``--traceback``."""

from __future__ import annotations

import pytest

from qwenkit.data.reader import DataError
from qwenkit.engine.generation.answers import UserFunctionError
from qwenkit.engine.run import rank
from qwenkit.errors import TRACEBACK_ENV, EveryRank, KnownCause


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


class _Known(KnownCause):
    pass


class _Everywhere(KnownCause, EveryRank):
    pass


def test_a_known_cause_is_one_line_naming_the_rank_its_traceback_in_the_log(tmp_path, capsys, monkeypatch):
    """A rank's own failure of a known cause (an engine's KV cache too small): ``rank N failed: <cause>;
    <fix>``, said by rank 0 (another rank's by the torchrun wrapper, from its event); one every rank raises
    alike (a save that failed) is rank 0's line as an input error is."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    log = tmp_path / "rank-00000.log"
    own = _raised(_Known("vLLM has no memory left for its KV cache; raise vllm.gpu_memory_utilization"))
    line = rank.report_failure(0, own, log)
    assert capsys.readouterr().err == f"{line}\n" and line == f"qwenkit train: rank 0 failed: {own} (its traceback: {log})"
    assert "Traceback" in log.read_text() and rank.one_line(own)
    assert rank.report_failure(1, own, tmp_path / "rank-00001.log").startswith("qwenkit train: rank 1 failed: vLLM")
    assert capsys.readouterr().err == ""
    alike = _raised(_Everywhere("checkpoint step 4 not saved: the disk is full"))
    assert rank.report_failure(0, alike, log) == f"qwenkit train: {alike} (rank 0; its traceback: {log})"
    rank.report_failure(1, alike, tmp_path / "rank-00001.log")
    assert capsys.readouterr().err.splitlines() == [f"qwenkit train: {alike} (rank 0; its traceback: {log})"]


def test_a_rank_that_lost_its_peer_after_the_peer_said_why_only_logs_it(tmp_path, capsys, monkeypatch):
    """Rank 1 records its failure, then exits; rank 0's collective then fails with a lost connection, which
    is no news: rank 0 writes it to its log, not to the console (rank 1's one line is the one)."""
    from qwenkit.engine.run import events

    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    peers = events.Follower(tmp_path)
    lost = _raised(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
    assert rank._looks_like_a_peer(lost) and not rank._a_peer_failed(peers, 0)
    events.EventLog(tmp_path, 0).failed(lost, "an earlier attempt's own")  # this rank's: no peer's news
    assert not rank._a_peer_failed(peers, 0)
    events.EventLog(tmp_path, 1).failed(_Known("x; y"), "qwenkit train: rank 1 failed: x; y", user_input=True)
    assert rank._a_peer_failed(peers, 0)
    log = tmp_path / "rank-00000.log"
    rank.report_failure(0, lost, log, quiet=True)
    assert capsys.readouterr().err == "" and "Connection reset by peer" in log.read_text()
