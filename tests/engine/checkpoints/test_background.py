"""A background save's thread (qwenkit.engine.checkpoints.background): the rank's manifest is written
only after its files are, in the write's thread, and a failed write reaches the caller as the write's own
error, with no manifest left to pass for a complete rank."""

from __future__ import annotations

import json
import zlib
from concurrent.futures import Future

import pytest

from qwenkit.engine.checkpoints.background import then_manifest
from qwenkit.engine.checkpoints.files import MANIFEST


def test_the_manifest_follows_the_write_and_lists_its_files(tmp_path):
    written: Future = Future()
    done = then_manifest(written, tmp_path, rank=1)
    assert not done.done()  # waits for the write, in its own thread: the caller goes on
    shard = b"weights of rank 1"
    (tmp_path / "__1_0.distcp").write_bytes(shard)
    (tmp_path / "rank-00001.pt").write_bytes(b"rng")
    (tmp_path / "__0_0.distcp").write_bytes(b"another rank's")
    assert not (tmp_path / MANIFEST.format(rank=1)).exists()
    written.set_result(None)
    assert done.result(timeout=60) is None
    manifest = json.loads((tmp_path / MANIFEST.format(rank=1)).read_text())
    assert manifest == {"__1_0.distcp": [len(shard), zlib.crc32(shard)], "rank-00001.pt": [3, zlib.crc32(b"rng")]}


def test_a_failed_write_reaches_the_caller_and_leaves_no_manifest(tmp_path):
    written: Future = Future()
    done = then_manifest(written, tmp_path, rank=0)
    written.set_exception(OSError("disk full"))
    with pytest.raises(OSError, match="disk full"):
        done.result(timeout=60)
    assert not (tmp_path / MANIFEST.format(rank=0)).exists()
