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
