"""qwenkit.data.prepare (``qwenkit data prepare``): the index it writes is the one ``data check`` (and so
training) finds under the run's fingerprint, scanned with ``--num-proc`` processes."""

from __future__ import annotations

import re

from data.test_cache import CORRUPT_ROW, write_set
from qwenkit.cli import main as cli_main


def test_prepare_then_check_reports_the_cache(tmp_path, capsys):
    path = write_set(tmp_path / "d")
    cache_dir = f"data.cache_dir={tmp_path / 'cache'}"
    assert cli_main(["data", "check", str(path), cache_dir]) == 1  # full decode: the damaged image is bad
    out = capsys.readouterr().out
    assert (
        f"{path}: row {CORRUPT_ROW}: corrupt_image" in out
        and f"cache: none for this data and config in {tmp_path / 'cache'}" in out
    )
    assert cli_main(["data", "prepare", str(path), "--num-proc", "2", cache_dir]) == 0
    out = capsys.readouterr().out
    assert "scanned 12 rows" in out and "x 2 processes" in out and "rows: 12 read, 11 good, 1 bad" in out
    assert cli_main(["data", "check", str(path), cache_dir]) == 1
    assert re.search(
        rf"cache: {tmp_path / 'cache'}/\w+\.npz matches \(built .*, 11 good of 12 rows",
        capsys.readouterr().out,
    )


def test_prepare_reads_the_rows_as_the_objective_does(tmp_path, capsys):
    """GRPO's index (prompts with references) and DPO's (pairs) are cached under keys of their own:
    prepare writes the one training under that objective, and data check, look for."""
    path = write_set(tmp_path / "d")
    args = [str(path), f"data.cache_dir={tmp_path / 'cache'}", "train.objective=grpo"]
    assert cli_main(["data", "prepare", *args]) == 0
    capsys.readouterr()
    assert cli_main(["data", "check", *args]) == 1  # (the damaged image)
    assert re.search(rf"cache: {tmp_path / 'cache'}/\w+\.npz matches", capsys.readouterr().out)
    assert cli_main(["data", "check", *args[:-1]]) == 1  # SFT's rows: another index
    assert "cache: none for this data and config" in capsys.readouterr().out
