"""Rows read from the file when a sample needs them (qwenkit.data.reader): the row spans of JSONL
and JSON arrays against ``json.loads`` of the whole file (rows, lines, and the line and column of
a malformed file), at block sizes that cut rows anywhere; the samples of every layout read lazily
(spans from the prepared index) equal the samples of the same rows parsed up front; and one rank's
memory at a start on 1k and on 1M rows differs by no more than the index's arrays."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_cfg
from multiproc import scaled
from test_data_layouts import cases, png

from qwenkit.data import cache, read_dataset, reader
from qwenkit.data.dataset import EncodedDataset, row_ranges, scan_rows
from qwenkit.data.index import SampleIndex
from qwenkit.data.reader import JsonSource
from qwenkit.data.report import Location
from qwenkit.model.paths import load_processor

ROOT = Path(__file__).resolve().parent.parent
ODD_ROWS = [
    {"messages": [{"role": "user", "content": 'say "hi" \\ then \u00e9\u4e2d\U0001f600'}], "n": 12345},
    {"a": [1, 2.5e-3, -7, True, None, {"b": ']}\\\\\\"'}], "s": "x" * 40},
    {"nested": {"deeper": [[[]], {}], "url": "https://x/y?z=[1]"}},
    {},
    9876543210,  # a bare number: complete only once the next byte is known (not a row: a bad one)
    {"last": 9876543210},
]


@pytest.fixture(params=[3, 7, 64, reader.BLOCK], ids=lambda b: f"block{b}")
def block(request, monkeypatch):
    """Small blocks cut rows, strings, escapes, multi-byte characters and numbers at every place."""
    monkeypatch.setattr(reader, "BLOCK", request.param)
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
    png(tmp_path / "img" / "a.png", (64, 48), (200, 30, 30))
    png(tmp_path / "img" / "b.png", (40, 90), (30, 30, 200))
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


# ---------------------------------------------------------------------------------------------
# One rank's memory at a start: 1k rows vs 1M rows

SMALL, TIMES = 1_000, 1_000  # the big set is the small one written TIMES times: 1,000,000 rows
START = """
import json, sys
from pathlib import Path
from qwenkit import config
from qwenkit.data import build
from qwenkit.model.paths import load_processor

def kib(key):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))

cfg = config.load(overrides={"data.path": sys.argv[1], "data.cache_dir": sys.argv[2], "train.micro_batch_size": 2})
bundle = build(cfg, load_processor(cfg))
# the first micro-batch of epoch 0, read by the dataset; not through the sampler's own iterator,
# which lists the epoch's batches as Python lists (data/sampler.py: ~64 bytes per sample)
order = bundle.sampler.epoch_order(0)
batch = bundle.collator([bundle.dataset[int(i)] for i in order[:2]])
index, source = bundle.dataset.index, bundle.dataset.sources[0]
arrays = sum(a.nbytes for a in index.columns.values())
arrays += sum(getattr(source.spans(), k).nbytes for k in ("start", "size", "line"))
arrays += order.nbytes
print(json.dumps({"origin": bundle.dataset.index_origin, "rows": len(bundle.dataset), "arrays": arrays,
                  "peak": kib("VmHWM") * 1024}))
"""


def _start(path: Path, cache_dir: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", START, str(path), str(cache_dir)], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=scaled(300),
    )  # fmt: skip
    return json.loads(out.stdout.splitlines()[-1])


def _tiled(index: SampleIndex, times: int) -> SampleIndex:
    """The index of a file that holds ``index``'s file ``times`` over (its rows numbered on)."""
    n = index.total
    pieces = []
    for k in range(times):
        cols = dict(index.columns, row=index.row + k * n)
        pieces.append(SampleIndex(cols, [], n))
    return SampleIndex.concat(pieces)


def _prepare_repeated(small: Path, big: Path, times: int, cache_dir: Path) -> SampleIndex:
    """Write ``big`` (``small`` ``times`` over) and its prepared index without scanning its rows:
    the small set's scanned index tiled, and the spans found in the big file. The processor is
    the run's (``load_processor``), so a start finds the index under its fingerprint."""
    big.write_bytes(small.read_bytes() * times)
    cfg = make_cfg(path=str(small), cache_dir=str(cache_dir))
    processor = load_processor(cfg)
    scanned, _ = read_dataset(cfg.data, processor)
    data = make_cfg(path=str(big), cache_dir=str(cache_dir)).data
    sources = reader.open_sources(big)
    tiled = _tiled(scanned.index, times)
    meta = {"built": "tiled by the test", "seconds": 0.0, "inputs": cache.fingerprint(sources, processor, data)[1]}
    tiled.save(cache.index_path(sources, processor, data), meta, reader.spans_arrays(sources))
    return tiled


@pytest.mark.slow
def test_start_memory_grows_by_the_index_arrays_only(tmp_path):
    """A start (data built, the first micro-batch read) on 1M rows takes no more memory than one
    on 1k rows plus the arrays that grow with the rows: the index, the row spans and the epoch
    order. (The sampler's lists of batches are not this test's: see the START script.)

    Scanning 1M rows costs ~5 CPU-minutes, beyond a test's budget, so the 1M-row file is the 1k
    file written 1,000 times and its index the 1k index tiled; that this is what the scan would
    write is checked here on 3 copies. Rows held as Python objects (the reader before spans) cost
    ~1.4 KB each: 1.4 GB here, against a margin of ~1.5x ~50 MB."""
    bench = ROOT / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        from data_scan import make_text_set
    finally:
        sys.path.remove(str(bench))
    small = make_text_set(tmp_path / "sets", SMALL)
    three = _prepare_repeated(small, small.parent / "three.jsonl", 3, tmp_path / "cache")
    cfg = make_cfg(path=str(small.parent / "three.jsonl"))
    scanned, report = read_dataset(cfg.data, load_processor(cfg), use_cache=False)
    assert report.skipped == 0 and int(scanned.index.kind_mask("image").sum()) == 3 * 8
    for name, column in scanned.index.columns.items():
        np.testing.assert_array_equal(three.columns[name], column, err_msg=name)

    _prepare_repeated(small, small.parent / "big.jsonl", TIMES, tmp_path / "cache")
    one_k = _start(small, tmp_path / "cache")
    one_m = _start(small.parent / "big.jsonl", tmp_path / "cache")
    assert one_m["origin"].startswith("index from cache") and one_k["origin"].startswith("index from cache")
    assert one_m["rows"] == SMALL * TIMES and one_k["rows"] == SMALL
    grown, arrays = one_m["peak"] - one_k["peak"], one_m["arrays"] - one_k["arrays"]
    # 1.5x: numpy's temporaries while the index file is read and the epoch order is drawn
    assert grown <= 1.5 * arrays, f"1M rows took {grown / 2**20:.0f} MiB more than 1k; arrays {arrays / 2**20:.0f} MiB"


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
