"""The row spans of JSONL files and JSON arrays (qwenkit.data.row_spans), read back through
:class:`~qwenkit.data.reader.JsonSource`, against ``json.loads`` of the whole file: rows, lines, and the
line and column of a malformed file, at block sizes that cut rows anywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwenkit.data import reader, row_spans
from qwenkit.data.reader import JsonSource
from qwenkit.data.report import Location

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


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
@pytest.mark.parametrize("most", [1, 4, 6, 9])
def test_a_count_up_to_most_reads_the_first_rows_only(tmp_path, block, suffix, most):
    """``most``: the spans of the file's first rows, as many as asked for at least (a JSONL file: its
    whole last block), a prefix of the whole file's; the rows after them are not read (the launcher's
    count of a dataset too small for a step, :func:`qwenkit.data.load.rows_at_most`)."""
    path = tmp_path / f"rows{suffix}"
    rows = [r for r in ODD_ROWS if isinstance(r, dict)]  # 5 rows
    path.write_text(json.dumps(rows) + "garbage after the rows: [ not parsed" if suffix == ".json"
                    else "".join(json.dumps(r) + "\n" for r in rows))  # fmt: skip
    found = row_spans.RowSpans.find(path, most=most)
    if suffix == ".json" and most > len(rows):  # the rows ran out: the file was read to its (bad) end
        assert found.error is not None and found.error.reason == "malformed_json"
        return
    assert found.error is None and min(most, len(rows)) <= len(found) <= len(rows)
    if suffix == ".json":
        assert len(found) == most  # one element at a time: the garbage after them is never read
    raw = path.read_bytes()
    assert [json.loads(raw[a : a + n]) for a, n in zip(found.start.tolist(), found.size.tolist())] == rows[: len(found)]


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
