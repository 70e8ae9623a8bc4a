"""The prepared index of a dataset: what the scan learned about every row, held as arrays.

A dataset of 10^6 rows must not cost 10^6 Python objects per rank, so the index is a handful
of numpy columns (bytes per good row in :meth:`SampleIndex.bytes_per_row`):

==================  =========  ===========================================================
column              dtype      per good row
==================  =========  ===========================================================
``source``          int32      index into the dataset's sources (files)
``row``             int32      row in that source
``length``          int32      tokens, media included, after ``data.max_length``
``label_tokens``    int32      learned tokens (assistant replies and their ``<|im_end|>``)
``truncated``       bool       ``data.truncate_text`` cut the text after the last image
``media_offsets``   int64      row ``i``'s media items are ``media_*[offsets[i]:offsets[i+1]]``
==================  =========  ===========================================================

Media items (images and videos: every kind that is cut into a ``(t, h, w)`` patch grid) share
flat per-item columns: ``media_kind`` (uint8, a code of :data:`MEDIA_KINDS`), ``media_grid``
(int32 ``[M, 3]``) and ``media_meta`` (float64 ``[M, 4]``: a video's decodable frames, frame
rate, width and height, as the probe measured them, from which the frame plan follows; zeros
for an image). An audio item (:mod:`qwenkit.data.audio`) keeps ``(mel frames, placeholder tokens, 0)``
in ``media_grid`` and ``(samples at 16 kHz, 16000, 0, 0)`` in ``media_meta``. Items keep the row's
order within each kind.

Bad rows are few and need their text (file, row, line, id, reason, detail), so they are kept
as records (:class:`BadRecord`), in dataset order, next to the arrays.
"""

from __future__ import annotations

import json
import os
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from qwenkit.data.report import BadSample, BadSampleReport, Location
from qwenkit.data.video import VideoMeta

MEDIA_KINDS = {"image": 0, "video": 1, "audio": 2}
ROW_COLUMNS = {
    "source": np.int32,
    "row": np.int32,
    "length": np.int32,
    "label_tokens": np.int32,
    "truncated": np.bool_,
}
MEDIA_COLUMNS = {"media_kind": np.uint8, "media_grid": np.int32, "media_meta": np.float64}
VIDEO_META = ("frames", "fps", "width", "height")  # the media_meta columns, VideoMeta's fields
# bump when the columns or their meaning change: older cache files are then ignored (3: row spans added;
# 4: a preference pair whose two sides are the same is a bad pair, same_replies; 5: a GRPO prompt with
# nothing in it is a bad row, empty_prompt; 6: rows' audios read, an audio item's grid is (mel frames, tokens, 0);
# 7: an audio's frames as its family's HF processor pads a row's audios, one frame more or less than 6's;
# 8: tool rows read (tools, calls, responses), where 7 refused a row with 'tools' or a tool role)
FORMAT = 8


@dataclass(frozen=True)
class BadRecord:
    """A bad row (or, with ``row=None``, an unreadable file) as plain data, for the cache file."""

    source: int
    file: str
    row: int | None
    line: int | None
    id: str | None
    reason: str
    detail: str

    @classmethod
    def of(cls, source: int, bad: BadSample) -> BadRecord:
        w = bad.where
        return cls(source, w.file, w.row, w.line, w.id, bad.reason, bad.detail)

    def error(self) -> BadSample:
        return BadSample(Location(self.file, self.row, self.line, self.id), self.reason, self.detail)


@dataclass(slots=True)
class SampleInfo:
    """One good row, read out of the index (built on request; the index keeps no such objects)."""

    source: int
    row: int
    length: int
    grids: list[tuple[int, int, int]]
    label_tokens: int
    truncated: bool
    videos: list[VideoMeta]
    video_grids: list[tuple[int, int, int]]


class SampleIndex:
    """Columns of the good rows, media items, bad records and the number of rows read."""

    def __init__(self, columns: dict[str, np.ndarray], bad: list[BadRecord], total: int):
        self.columns, self.bad, self.total = columns, bad, total
        for name in (*ROW_COLUMNS, *MEDIA_COLUMNS, "media_offsets"):
            setattr(self, name, columns[name])

    def __len__(self) -> int:
        return len(self.length)

    def _items(self, i: int, kind: str) -> np.ndarray:
        lo, hi = self.media_offsets[i], self.media_offsets[i + 1]
        return lo + np.flatnonzero(self.media_kind[lo:hi] == MEDIA_KINDS[kind])

    def grids(self, i: int, kind: str = "image") -> list[tuple[int, int, int]]:
        """Row ``i``'s patch grids of one media kind, in the row's order."""
        return [tuple(int(x) for x in self.media_grid[k]) for k in self._items(i, kind)]

    def videos(self, i: int) -> list[VideoMeta]:
        """Row ``i``'s videos as the probe measured them."""
        return [VideoMeta(int(m[0]), float(m[1]), int(m[2]), int(m[3])) for m in self.media_meta[self._items(i, "video")]]

    def kind_mask(self, kind: str) -> np.ndarray:
        """``[M]`` bool: which media items are of ``kind``."""
        return self.media_kind == MEDIA_KINDS[kind]

    @property
    def has_videos(self) -> bool:
        return bool(self.kind_mask("video").any())

    def info(self, i: int) -> SampleInfo:
        return SampleInfo(
            int(self.source[i]), int(self.row[i]), int(self.length[i]), self.grids(i),
            int(self.label_tokens[i]), bool(self.truncated[i]), self.videos(i), self.grids(i, "video"),
        )  # fmt: skip

    @property
    def media_per_row(self) -> np.ndarray:
        return np.diff(self.media_offsets)  # [N]

    def bytes_per_row(self) -> float:
        """Index bytes (arrays; bad records excluded) per good row."""
        return sum(a.nbytes for a in self.columns.values()) / max(len(self), 1)

    def report(self) -> BadSampleReport:
        report = BadSampleReport(total=self.total)
        for rec in self.bad:
            report.add_bad(rec.error())
        report.total = self.total  # add_bad counts rows; file-level records are not rows
        return report

    # -- building -------------------------------------------------------------------------------

    @classmethod
    def concat(cls, pieces: list[SampleIndex]) -> SampleIndex:
        """Pieces scanned over consecutive row ranges, in order, as one index."""
        cols = {
            name: np.concatenate([p.columns[name] for p in pieces]) for name in (*ROW_COLUMNS, *MEDIA_COLUMNS)
        }
        counts = np.concatenate([p.media_per_row for p in pieces])
        cols["media_offsets"] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(cols, [b for p in pieces for b in p.bad], sum(p.total for p in pieces))

    def take(self, indices) -> SampleIndex:
        """The rows at ``indices`` (in that order) with their media items; bad records are not carried."""
        rows = np.asarray(indices, dtype=np.int64)
        cols = {name: self.columns[name][rows] for name in ROW_COLUMNS}
        lo, hi = self.media_offsets[rows], self.media_offsets[rows + 1]  # [n]
        items = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi)] or [np.zeros(0, np.int64)]).astype(np.int64)
        for name in MEDIA_COLUMNS:
            cols[name] = self.columns[name][items]
        cols["media_offsets"] = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
        return SampleIndex(cols, [], len(rows))

    # -- the cache file -------------------------------------------------------------------------

    def save(self, path: Path, meta: dict, extra: dict[str, np.ndarray] | None = None) -> None:
        """Write atomically: a temporary file renamed into place, so a killed writer leaves no index.

        ``extra``: more arrays kept in the same file (the row spans of the data files,
        :func:`qwenkit.data.reader.spans_arrays`)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {"format": FORMAT, "total": self.total, "bad": [asdict(b) for b in self.bad], **meta}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                np.savez(
                    f, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **self.columns, **(extra or {})
                )
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: Path) -> tuple[SampleIndex, dict, dict[str, np.ndarray]] | None:
        """``(index, header, extra arrays)``, or None when the file is missing, unreadable or of another format.

        The arrays are read-only memory maps of the file (``np.savez`` stores them uncompressed):
        a start reads nothing per row, and the ranks of a node share one copy, in the page cache.
        """
        try:
            with zipfile.ZipFile(path) as z:
                with z.open("header.npy") as f:
                    header = json.loads(np.lib.format.read_array(f, allow_pickle=False).tobytes())
                if header.get("format") != FORMAT:
                    return None
                arrays = {info.filename[: -len(".npy")]: _mapped(path, info) for info in z.infolist()
                          if info.filename != "header.npy"}  # fmt: skip
            columns = {k: arrays.pop(k) for k in (*ROW_COLUMNS, *MEDIA_COLUMNS, "media_offsets")}
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # cut short, damaged, foreign
            return None
        bad = [BadRecord(**b) for b in header.pop("bad")]
        return cls(columns, bad, header["total"]), header, arrays


def _mapped(path: Path, info: zipfile.ZipInfo) -> np.ndarray:
    """A stored (uncompressed) ``.npy`` member of the zip file ``path``, as a read-only memory map."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{path}: {info.filename} is compressed")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)  # the member's local header: its name and extra field lengths at bytes 26-29
        if local[:4] != b"PK\x03\x04":
            raise ValueError(f"{path}: no local header for {info.filename}")
        f.seek(info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little"))
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"{path}: {info.filename} is .npy format {version}")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
        offset = f.tell()
    if dtype.hasobject:
        raise ValueError(f"{path}: {info.filename} holds Python objects")
    if int(np.prod(shape)) == 0:
        return np.empty(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


def empty_columns() -> dict[str, list]:
    """Growing lists for one scan piece; :func:`to_index` turns them into arrays."""
    return {name: [] for name in (*ROW_COLUMNS, "media_count", *MEDIA_COLUMNS)}


def to_index(lists: dict[str, list], bad: list[BadRecord], total: int) -> SampleIndex:
    cols = {name: np.asarray(lists[name], dtype=dt) for name, dt in ROW_COLUMNS.items()}
    cols["media_kind"] = np.asarray(lists["media_kind"], dtype=np.uint8)
    cols["media_grid"] = np.asarray(lists["media_grid"], dtype=np.int32).reshape(-1, 3)
    cols["media_meta"] = np.asarray(lists["media_meta"], dtype=np.float64).reshape(-1, len(VIDEO_META))
    cols["media_offsets"] = np.concatenate([[0], np.cumsum(lists["media_count"], dtype=np.int64)]).astype(
        np.int64
    )
    return SampleIndex(cols, bad, total)
