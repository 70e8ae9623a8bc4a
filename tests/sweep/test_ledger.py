"""qwenkit.sweep.ledger: the append-only ledger, a trial's last row, the status table and the result line."""

from __future__ import annotations

import pytest

from qwenkit.sweep import ledger
from sweep.sweeps import run_qwenkit


def test_status_of_a_folder_without_a_ledger_is_a_user_error(tmp_path):
    proc = run_qwenkit("sweep", "status", str(tmp_path))
    assert proc.returncode == 2 and "sweep.jsonl does not exist" in proc.stderr


def test_the_last_row_of_a_trial_is_its_state_and_a_cut_line_is_left_out(tmp_path):
    ledger.append(tmp_path, {"trial": "lr0.1", "status": "running", "attempt": 1, "metrics": {}})
    ledger.append(tmp_path, {"trial": "lr0.2", "status": "running", "attempt": 1, "metrics": {}})
    done = {"trial": "lr0.1", "status": "done", "attempt": 1, "exit_code": 0,
            "metrics": {"steps": 4, "loss": 0.271828, "eval_loss": 0.3, "wall_time": 31.4}}  # fmt: skip
    ledger.append(tmp_path, done)
    with open(tmp_path / ledger.LEDGER, "a") as f:
        f.write('{"trial": "lr0.2", "status": "do')  # a writer killed mid-line
    assert [r["status"] for r in ledger.read(tmp_path)] == ["running", "running", "done"]
    assert {t: r["status"] for t, r in ledger.latest(tmp_path).items()} == {"lr0.1": "done", "lr0.2": "running"}
    rows = ledger.table_rows(tmp_path)
    assert rows[0] | {} == {"trial": "lr0.1", "status": "done", "attempt": 1, "exit": 0, "steps": 4, "loss": 0.271828,
                            "eval_loss": 0.3, "eval_accuracy": None, "wall_s": 31.4, "error": ""}  # fmt: skip
    table = ledger.format_table(rows).splitlines()
    assert table[0].split() == list(rows[0]) and table[1].split()[:6] == ["lr0.1", "done", "1", "0", "4", "0.2718"]
    with pytest.raises(ValueError, match="ledger status must be one of running, done, failed, interrupted, got 'ok'"):
        ledger.append(tmp_path, {"trial": "lr0.3", "status": "ok"})


def test_the_result_line_says_what_ended_and_how():
    done = {"status": "done", "metrics": {"loss": 0.271828, "eval_loss": 0.28, "wall_time": 31.4}, "resumed_from": 2}
    assert ledger.result_text(done) == "done in 31 s (resumed from step 2): loss 0.2718, eval_loss 0.28"
    failed = {"status": "failed", "exit_code": 1, "error": "rank 0: boom", "metrics": {}}
    assert ledger.result_text(failed) == "failed, exit code 1: rank 0: boom"
    assert ledger.result_text({"status": "done", "skipped": True, "metrics": {}}) == "done earlier"
