"""The prepared-index cache: scan a dataset once, over ranks and processes; reuse it while nothing changed.

The index (:class:`~qwenkit.data.index.SampleIndex`) lives in ``data.cache_dir`` (default
``$QWENKIT_CACHE/data-index``, i.e. ``~/.cache/qwenkit/data-index``) as ``<fingerprint>.npz``.
The fingerprint is a hash of everything that changes what the scan finds:

- the data files: path, size and mtime of each (``data.fingerprint: content`` hashes their
  bytes instead); a ``datasets`` source by the library's own fingerprint;
- the processor: its model family (the template and the video rule), the tokenizer (its full
  serialisation) and the image processor's settings;
- every data setting that changes the encoding or the checks (:data:`ENCODING_KEYS`) and
  ``data.verify_images``.

Image files are not in the fingerprint (a dataset has as many as it has rows); an image changed
after the scan shows as a grid mismatch or a bad sample when it is loaded.

A cold start splits the rows over the ranks (each scans ``1/world``, with ``data.num_proc``
processes), gathers the pieces on every rank, and rank 0 alone writes the file, atomically. A
start uses the cache only when every rank finds it, so the ranks never disagree about whether
to join the scan's collective.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from qwenkit.config import DataConfig
from qwenkit.data.dataset import Source, row_ranges, scan_parallel
from qwenkit.data.index import FORMAT, BadRecord, SampleIndex
from qwenkit.data.reader import HFSource, find_rows, spans_arrays, use_spans
from qwenkit.model.processor import Processor

# data settings that change the tokens, the grids or which rows are bad
ENCODING_KEYS = (
    "layout", "image_dir", "system_prompt", "max_length", "truncate_text",
    "min_pixels", "max_pixels", "min_image_side", "max_aspect_ratio", "verify_images",
    "video_dir", "video_fps", "video_min_frames", "video_max_frames", "video_max_pixels", "video_total_pixels",
    "use_audio_in_video",  # each video's track joins the row's audios (the index's audio grids) and its span
)  # fmt: skip
# data settings that leave the index as it is (path and tiny_samples are in it through the files)
RUN_KEYS = (
    "path", "tiny_samples", "on_bad_sample", "max_bad_fraction", "shuffle", "num_workers",
    "cache_dir", "fingerprint", "num_proc", "packing", "max_tokens_per_batch", "eval_path", "eval_fraction",
    "tiny_eval_samples", "tiny_task",
)  # fmt: skip


def cache_dir(data: DataConfig) -> Path:
    if data.cache_dir:
        return Path(data.cache_dir).expanduser()
    return Path(os.environ.get("QWENKIT_CACHE", Path.home() / ".cache" / "qwenkit")) / "data-index"


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _source_key(source: Source, content: bool) -> dict:
    if isinstance(source, HFSource):
        return {"datasets": source.name, "fingerprint": source.fingerprint}
    path = source.path.resolve()
    if content:
        return {"path": str(path), "sha256": _file_hash(path)}
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _processor_key(processor: Processor) -> dict:
    tok = processor.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    return {
        "family": processor.family.name,  # the template and the video rule: another family's token counts differ
        "tokenizer": hashlib.sha256(text.encode()).hexdigest(),
        "image_processor": json.loads(
            json.dumps(processor.image_processor.to_dict(), sort_keys=True, default=str)
        ),
    }


def fingerprint(sources: list[Source], processor: Processor, data: DataConfig, prompts: bool = False) -> tuple[str, dict]:
    """``(hex digest, the inputs hashed)`` of a dataset under a processor and data settings.

    ``prompts``: scanned for GRPO, where a prompt with a ``solution`` / ``answer`` column is a good row."""
    inputs = {
        "format": FORMAT,
        "sources": [_source_key(s, data.fingerprint == "content") for s in sources],
        "processor": _processor_key(processor),
        "data": {k: getattr(data, k) for k in ENCODING_KEYS},
    }
    if prompts:  # only then: the other objectives keep the keys of the indexes already cached
        inputs["prompts"] = True
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32], inputs


def index_path(sources: list[Source], processor: Processor, data: DataConfig, prompts: bool = False) -> Path:
    return cache_dir(data) / f"{fingerprint(sources, processor, data, prompts)[0]}.npz"


@dataclass
class Prepared:
    """A ready index and where it came from (``origin`` is one line for a log or a notebook)."""

    index: SampleIndex
    from_cache: bool
    path: Path | None
    seconds: float
    origin: str


def prepare(
    sources: list[Source],
    processor: Processor,
    data: DataConfig,
    rank: int = 0,
    world_size: int = 1,
    use_cache: bool = True,
    num_proc: int | None = None,
    progress: bool = False,
    prompts: bool = False,
) -> Prepared:
    """The index of ``sources``: read from the cache when every rank has it, else scanned and written.

    From the cache, the JSON sources take their row spans from the index file: no data file is
    read until a sample is. ``progress``: bars on stderr for finding the rows and the scan."""
    began = time.perf_counter()
    key, inputs = fingerprint(sources, processor, data, prompts) if use_cache else (None, None)
    path = cache_dir(data) / f"{key}.npz" if use_cache else None
    loaded = SampleIndex.load(path) if path is not None else None
    if _all_ranks(loaded is not None, world_size):
        index, header, spans = loaded
        use_spans(sources, spans)
        seconds = time.perf_counter() - began
        return Prepared(
            index,
            True,
            path,
            seconds,
            f"index from cache {path} (built {header['built']}; read in {seconds:.2f} s)",
        )

    num_proc = data.num_proc if num_proc is None else num_proc
    find_rows(sources, num_proc, progress)  # every rank: each needs every file's row spans to read samples
    n = int(row_ranges(sources)[-1])
    lo, hi = n * rank // world_size, n * (rank + 1) // world_size
    index = scan_parallel(sources, processor, data, lo, hi, data.verify_images == "full", num_proc, progress, prompts)
    if world_size > 1 and dist.is_initialized():
        pieces: list = [None] * world_size
        dist.all_gather_object(
            pieces, index
        )  # rank r's piece is rows lo:hi of rank r: concat keeps row order
        index = SampleIndex.concat(pieces)
    files = [BadRecord.of(s, src.error) for s, src in enumerate(sources) if src.error is not None]
    if files:  # an unreadable file counts as one bad entry, listed before the rows of later files
        index.bad = sorted(files + index.bad, key=lambda b: (b.source, -1 if b.row is None else b.row))
        index.total += len(files)
    seconds = time.perf_counter() - began
    how = f"scanned {n} rows in {seconds:.1f} s ({world_size} rank{'s' if world_size > 1 else ''} x {num_proc} process{'es' if num_proc > 1 else ''})"
    if path is None:
        return Prepared(index, False, None, seconds, how)
    if rank == 0:  # one writer; the others have the same gathered index in memory
        meta = {"built": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": seconds, "inputs": inputs}
        index.save(path, meta, spans_arrays(sources))
    return Prepared(index, False, path, seconds, f"{how}; index written to {path}")


def _all_ranks(found: bool, world_size: int) -> bool:
    """True when every rank found the cache (a rank that did not would scan, and wait for the others)."""
    if world_size == 1 or not dist.is_initialized():
        return found
    flag = torch.tensor([int(found)])
    if dist.get_backend() != "gloo":
        flag = flag.to(torch.accelerator.current_accelerator())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def status(sources: list[Source], processor: Processor, data: DataConfig, prompts: bool = False) -> str:
    """One line for ``qwenkit data check``: does the cache hold this dataset's index under this config?"""
    path = index_path(sources, processor, data, prompts)
    loaded = SampleIndex.load(path)
    if loaded is None:
        others = sorted(p.name for p in cache_dir(data).glob("*.npz")) if cache_dir(data).is_dir() else []
        hint = (
            f" ({len(others)} other index file{'s' if len(others) != 1 else ''} there do not match)"
            if others
            else ""
        )
        return f"cache: none for this data and config in {cache_dir(data)}{hint}; `qwenkit data prepare` builds it"
    index, header, _ = loaded
    return (
        f"cache: {path} matches (built {header['built']}, {len(index)} good of {index.total} rows, "
        f"{index.bytes_per_row():.0f} bytes/row)"
    )
