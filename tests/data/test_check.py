"""qwenkit.data.check (``qwenkit data check``): a good dataset passes with its summary, every bad sample
listed by file and row, unreadable data and a bad config exit 2."""

from __future__ import annotations

import json
import re

import pytest
from conftest import write_png

from data.test_report import MLLM_DEMO, good_row
from qwenkit.cli import main as cli_main


@pytest.mark.skipif(not MLLM_DEMO.is_file(), reason="the mllm_demo dataset is not on this machine")
def test_check_mllm_demo_passes(capsys):
    assert cli_main(["data", "check", str(MLLM_DEMO)]) == 0
    out = capsys.readouterr().out
    assert "samples: 6 good, 0 bad" in out and "images: 8\n" in out and "tokens per sample: min" in out
    assert out.rstrip().endswith("OK")


def test_check_tiny_passes(capsys):
    assert cli_main(["data", "check", "tiny", "data.tiny_samples=5"]) == 0
    assert "samples: 5 good, 0 bad" in capsys.readouterr().out


def test_check_lists_every_bad_sample_and_fails(tmp_path, capsys):
    write_png(tmp_path / "ok.png", (64, 64), (0, 0, 0))
    rows = [
        good_row(),
        good_row("missing.png"),
        {"messages": [{"role": "user", "content": "Hi"}]},
        good_row("missing.png"),
    ]
    (tmp_path / "data.json").write_text(json.dumps(rows))
    (tmp_path / "more.jsonl").write_text(json.dumps(good_row()) + "\n{oops\n")
    # the config says skip; the check still reports everything and fails
    assert cli_main(["data", "check", str(tmp_path), "data.on_bad_sample=skip"]) == 1
    out = capsys.readouterr().out
    assert "samples: 2 good, 4 bad, 6 rows read" in out
    for line in (
        f"{tmp_path / 'data.json'}: row 1: missing_image",
        f"{tmp_path / 'data.json'}: row 2: no_reply",
        f"{tmp_path / 'data.json'}: row 3: missing_image",
        f"{tmp_path / 'more.jsonl'}: row 1 (line 2): malformed_json",
    ):
        assert line in out
    assert "missing_image        2" in out and out.rstrip().endswith("FAILED: 4 bad samples")


def test_check_unreadable_path_exits_2(tmp_path, capsys):
    assert cli_main(["data", "check", str(tmp_path / "nope.json")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["data", "check", "tiny", "data.max_length=0"], r"data\.max_length must be > 0, got 0"),
        (["data", "prepare", "tiny", "data.max_length=0"], r"data\.max_length must be > 0, got 0"),
        (["data", "prepare", "tiny", "--num-proc", "0"], r"data\.num_proc must be >= 1, got 0"),
    ],
)
def test_data_commands_refuse_a_bad_config_with_exit_2(argv, problem, capsys):
    assert cli_main(argv) == 2
    assert re.search(problem, capsys.readouterr().err)
