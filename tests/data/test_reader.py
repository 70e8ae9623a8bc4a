"""Rows read from the file when a sample needs them (qwenkit.data.reader): the row spans of JSONL
and JSON arrays against ``json.loads`` of the whole file (rows, lines, and the line and column of
a malformed file), at block sizes that cut rows anywhere; the samples of every layout read lazily
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
from qwenkit.data import read_dataset, reader, row_spans
from qwenkit.data.dataset import EncodedDataset, row_ranges, scan_rows
from qwenkit.data.reader import JsonSource
from qwenkit.data.report import Location

ROOT = Path(__file__).resolve().parents[2]
ODD_ROWS = [
    {"messages": [{"role": "user", "content": 'say "hi" \\ then \u00e9\u4e2d\U0001f600'}], "n": 12345},
    {"a": [1, 2.5e-3, -7, True, None, {"b": ']}\\\\\\"'}], "s": "x" * 40},
    {"nested": {"deeper": [[[]], {}], "url": "https://x/y?z=[1]"}},
    {},
    9876543210,  # a bare number: complete only once the next byte is known (not a row: a bad one)
    {"last": 9876543210},
]


@pytest.fixture(params=[3, 7, 64, row_spans.BLOCK], ids=lambda b: f"block{b}")
def block(request, monkeypatch):
    """Small blocks cut rows, strings, escapes, multi-byte characters and numbers at every place."""
    monkeypatch.setattr(row_spans, "BLOCK", request.param)
    return request.param


def rows_of(path: Path) -> list:
    source = JsonSource(path)
    assert source.error is None
    return [source.row(i) for i in range(len(source))]


@pytest.mark.parametrize("indent", [None, 2])
@pytest.mark.parametrize("bom", [False, True])
def test_json_array_rows_equal_json_loads(tmp_path, block, indent, bom):
    path = tmp_path / "rows.json"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + f" {json.dumps(ODD_ROWS, indent=indent)}\n ".encode())
    assert rows_of(path) == json.loads(path.read_bytes().decode("utf-8-sig")) == ODD_ROWS
    assert JsonSource(path).location(1) == Location(str(path), row=1)


def test_jsonl_rows_and_lines_equal_splitlines(tmp_path, block):
    text = "\n".join(json.dumps(r) for r in ODD_ROWS[:2]) + "\n\n  \t\n" + json.dumps(ODD_ROWS[2]) + "\r\n"
    text += "{broken\n" + json.dumps(ODD_ROWS[3]) + "\n   " + json.dumps(ODD_ROWS[4])  # no final newline
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    # the reference: the reader before spans (splitlines, blank lines skipped, lines numbered from 1)
    lines = [(n, raw) for n, raw in enumerate(path.read_bytes().splitlines(), start=1) if raw.strip()]
    source = JsonSource(path)
    assert len(source) == len(lines) == 6
    for i, (n, raw) in enumerate(lines):
        assert source.location(i) == Location(str(path), row=i, line=n)
        if n == 6:
            with pytest.raises(reader.BadSample, match=rf"{path}: row 3 \(line 6\): malformed_json: column 2"):
                source.row(i)
        else:
            assert source.row(i) == json.loads(raw.decode("utf-8-sig"))


BROKEN = {
    "trailing comma": '[{"a": 1},\n {"b": 2},\n]',
    "missing comma": '[{"a": 1}\n {"b": 2}]',
    "bad element": '[{"a": 1},\n {"b": tru}]',
    "unclosed string": '[{"a": 1},\n {"b": "never ends}]',
    "unclosed array": '[{"a": 1},\n {"b": 2}',
    "extra data": '[{"a": 1}]\n x',
    "empty": "",
    "cut short": '[{"messages": ',
}


@pytest.mark.parametrize("case", BROKEN)
def test_malformed_json_array_is_named_as_json_loads_names_it(tmp_path, block, case):
    path = tmp_path / "broken.json"
    path.write_text(BROKEN[case])
    with pytest.raises(json.JSONDecodeError) as want:
        json.loads(BROKEN[case])
    got = JsonSource(path).error
    assert (got.where.line, got.reason, got.detail) == (
        want.value.lineno, "malformed_json", f"column {want.value.colno}: {want.value.msg}"
    )
    assert len(JsonSource(path)) == 0


def test_a_json_array_not_utf8_or_not_an_array_is_one_bad_entry(tmp_path, block):
    path = tmp_path / "latin.json"
    path.write_bytes(b'[{"a": "caf\xe9"}]')
    with pytest.raises(UnicodeDecodeError) as want:
        path.read_bytes().decode()
    assert f"not UTF-8 text ({want.value.reason} at byte {want.value.start})" in str(JsonSource(path).error)
    path.write_text('{"messages": []}')
    assert "top level must be a JSON array of rows, got dict" in str(JsonSource(path).error)


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
