"""Rows read from the file when a sample needs them (qwenkit.data.reader; the row spans it reads
them by: test_row_spans.py): the samples of every layout read lazily
(spans from the prepared index) equal the samples of the same rows parsed up front; many files'
rows found in parallel equal one process's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_cfg, write_png

from data.test_layouts import cases
from data.test_row_spans import BROKEN, ODD_ROWS
from qwenkit.data import read_dataset, reader
from qwenkit.data.dataset import EncodedDataset, row_ranges, scan_rows
from qwenkit.data.report import Location

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# Every layout: rows read lazily equal rows parsed up front


class EagerSource:
    """The reader before spans: every row parsed when the file is opened and held in a list."""

    def __init__(self, path: Path):
        self.name, self.base_dir, self.error = str(path), path.parent, None
        text = path.read_text()
        self.rows = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
        lines = [n for n, x in enumerate(text.splitlines(), start=1) if x.strip()]
        self.lines = [None] * len(self.rows) if path.suffix == ".json" else lines

    def __len__(self) -> int:
        return len(self.rows)

    def location(self, i: int) -> Location:
        return Location(self.name, row=i, line=self.lines[i])

    def row(self, i: int):
        return self.rows[i]


@pytest.fixture
def media(tmp_path):
    """The images test_data_layouts' rows name (``img/a.png``, ``img/b.png``)."""
    write_png(tmp_path / "img" / "a.png", (64, 48), (200, 30, 30))
    write_png(tmp_path / "img" / "b.png", (40, 90), (30, 30, 200))
    return tmp_path


def test_lazy_rows_are_the_eager_rows_for_every_layout(media, processor, tmp_path):
    """One file per format with a row of every layout (plus a row no layout reads); the lazy
    dataset comes from the warm index (spans from the cache file, no pass over the data)."""
    rows = [row for _, row, _ in cases(media).values()] + [{"text": "no layout"}]
    files = {
        ".jsonl": "".join(json.dumps(r, ensure_ascii=False) + "\n\n" for r in rows),
        ".json": json.dumps(rows, indent=1, ensure_ascii=False),
    }
    for suffix, text in files.items():
        path = media / f"layouts{suffix}"
        path.write_text(text)
        data = make_cfg(path=str(path), cache_dir=str(tmp_path / "cache"), shuffle=False).data
        read_dataset(data, processor)  # cold: writes the index and the spans
        lazy, report = read_dataset(data, processor)
        assert lazy.index_origin.startswith("index from cache")
        assert lazy.sources[0]._spans is not None and report.skipped == 1
        eager_sources = [EagerSource(path)]
        index = scan_rows(eager_sources, processor, data, 0, int(row_ranges(eager_sources)[-1]), False)
        for name, column in index.columns.items():
            np.testing.assert_array_equal(lazy.index.columns[name], column, err_msg=name)
        assert [b.error().where for b in lazy.index.bad] == [b.error().where for b in index.bad]
        eager = EncodedDataset(eager_sources, index, processor, data)
        assert len(lazy) == len(eager) == len(rows) - 1
        for i in range(len(eager)):
            assert lazy.conversation(i) == eager.conversation(i), (suffix, i)
            x, y = lazy[i], eager[i]
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), (suffix, i)



def test_rows_of_many_files_found_in_parallel_equal_one_process(tmp_path):
    for k in range(3):
        (tmp_path / f"part{k}.jsonl").write_text("".join(json.dumps({"k": k, "i": i}) + "\n" for i in range(5 + k)))
    (tmp_path / "part3.json").write_text(json.dumps(ODD_ROWS))
    (tmp_path / "part4.json").write_text(BROKEN["missing comma"])
    one, two = reader.open_sources(tmp_path), reader.open_sources(tmp_path)
    reader.find_rows(one, num_proc=1)
    reader.find_rows(two, num_proc=2)
    assert one[4].error is not None and str(two[4].error) == str(one[4].error)  # sent back by the pool
    for a, b in zip(one, two):
        for name in ("start", "size", "line"):
            np.testing.assert_array_equal(getattr(a.spans(), name), getattr(b.spans(), name), err_msg=name)
        assert [a.row(i) for i in range(len(a))] == [b.row(i) for i in range(len(b))]
    assert sum(len(s) for s in two) == 5 + 6 + 7 + len(ODD_ROWS)
    arrays = reader.spans_arrays(two)
    three = reader.open_sources(tmp_path)
    reader.use_spans(three, arrays)
    assert [three[3].row(i) for i in range(len(ODD_ROWS))] == ODD_ROWS
