"""qwenkit.data.index: the prepared index is numpy arrays (under 200 bytes a row), and one rank's memory at a
start on 1k and on 1M rows differs by no more than the index's arrays, the row spans and the epoch order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import make_cfg
from multiproc import scaled

from data.test_cache import data_cfg, write_set
from qwenkit.data import cache, read_dataset, reader
from qwenkit.data.index import SampleIndex
from qwenkit.model.paths import load_processor

ROOT = Path(__file__).resolve().parents[2]


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


def test_index_is_arrays_under_200_bytes_per_row(tmp_path, processor):
    dataset, _ = read_dataset(data_cfg(write_set(tmp_path / "d", corrupt=False), tmp_path), processor)
    assert all(isinstance(a, np.ndarray) for a in dataset.index.columns.values())
    assert dataset.index.bytes_per_row() <= 200
