"""Reading dataset rows from JSON, JSONL, directories of them, and Hugging Face ``datasets``.

A *source* is one file (or one HF dataset) that hands out raw rows by index, the
:class:`~qwenkit.data.report.Location` of each row, and the directory that relative image
paths start from. Rows stay raw dicts here; :mod:`qwenkit.data.conversation` interprets them.

- ``*.json``: one JSON array of rows. A file that does not parse loses an unknown number of
  rows, so it is one bad entry naming the line and column (and can never be skipped silently,
  see :func:`qwenkit.data.build`).
- ``*.jsonl``: one row per line; a line that does not parse is one bad row naming its line.
- a directory: its ``*.json``/``*.jsonl`` files (recursively, sorted), or a ``save_to_disk``
  dataset (``state.json`` + ``dataset_info.json``), or anything ``datasets.load_dataset``
  reads (parquet, arrow, ...).
- a ``datasets.Dataset`` object. HF rows are read in Arrow format, so image columns arrive
  as undecoded ``{"bytes", "path"}`` and a corrupt image is a bad row instead of a crash.

No rank holds a JSON file's rows. One pass over the file (:meth:`RowSpans.find`, 16 MiB at a
time) records where each row's bytes lie; a row is read from the file (``pread``) and parsed
when it is asked for, so the OS page cache, not each rank, holds the data, and a rank's memory
grows by the spans' 16 bytes per row (int64 start, int32 size, int32 line). The spans go into
the prepared index (:mod:`qwenkit.data.cache`), so a warm start reads no data file at all.
HF sources are Arrow tables, memory-mapped by ``datasets``.
"""

from __future__ import annotations

import codecs
import json
import multiprocessing
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from qwenkit.data.report import BadSample, Location

# LLaMA-Factory and HF keep metadata next to the data under this name; it is not data.
METADATA_FILES = {"dataset_info.json", "state.json"}
HF_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow"}
BLOCK = 1 << 24  # bytes read at a time while finding rows: the pass's memory, whatever the file's size
BOM = codecs.BOM_UTF8
WHITESPACE = b" \t\n\r\x0b\x0c"  # what bytes.strip() strips: a JSONL line of only these is no row
_JSON_WS = re.compile(r"[ \t\n\r]*")


class DataError(ValueError):
    """The dataset cannot be read at all (wrong path, unsupported format, no rows)."""


@dataclass
class RowSpans:
    """Where the rows of one JSON or JSONL file lie: row ``i`` is bytes ``start[i]:start[i]+size[i]``.

    ``start [n]`` int64, ``size [n]`` int32, ``line [n]`` int32 (a JSONL row's line; 0 for the
    rows of a JSON array, which are reported by row). ``error``: the file is unreadable as a
    whole (a JSON array that does not parse, or is not UTF-8); it then has no rows.
    """

    start: np.ndarray
    size: np.ndarray
    line: np.ndarray
    error: BadSample | None = None

    def __len__(self) -> int:
        return len(self.start)

    @classmethod
    def empty(cls, error: BadSample | None = None) -> RowSpans:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32), error)

    @classmethod
    def find(cls, path: Path, bar: tqdm | None = None) -> RowSpans:
        """One pass over ``path`` (``bar`` counts its bytes)."""
        with open(path, "rb") as f:
            return _jsonl_spans(f, bar) if path.suffix == ".jsonl" else _json_spans(f, str(path), bar)


def _jsonl_spans(f, bar: tqdm | None) -> RowSpans:
    """Lines that are not blank (``bytes.strip()`` leaves something), numbered from 1."""
    starts, sizes, lines = [], [], []
    carry, base, lineno = b"", 0, 0  # carry: the unfinished last line, from file offset base
    while True:
        block = f.read(BLOCK)
        if bar is not None:
            bar.update(len(block))
        buf = carry + block if carry else block
        if not buf:
            break
        ends = np.flatnonzero(np.frombuffer(buf, np.uint8) == 10)  # [lines] the newlines
        if not block:  # end of file: the last line has no newline
            ends = np.append(ends, len(buf))
        begins = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        size = ends - begins
        # blank lines are rare: only lines that are empty or start with whitespace are looked at
        head = np.frombuffer(buf, np.uint8)[np.minimum(begins, len(buf) - 1)]
        maybe = np.flatnonzero((size == 0) | np.isin(head, np.frombuffer(WHITESPACE, np.uint8)))
        blank = [k for k in maybe.tolist() if not buf[begins[k] : ends[k]].strip()]
        keep = np.ones(len(ends), bool)
        keep[blank] = False
        starts.append(base + begins[keep])
        sizes.append(size[keep].astype(np.int32))
        lines.append((lineno + 1 + np.flatnonzero(keep)).astype(np.int32))
        lineno += len(ends)
        if not block:
            break
        cut = int(ends[-1]) + 1 if len(ends) else 0
        carry, base = buf[cut:], base + cut
    if not starts:
        return RowSpans.empty()
    return RowSpans(np.concatenate(starts), np.concatenate(sizes), np.concatenate(lines))


def _json_spans(f, name: str, bar: tqdm | None) -> RowSpans:
    """The elements of a top-level JSON array, found by parsing one element at a time.

    The bytes are decoded as Latin-1 (one character per byte, so positions are byte offsets)
    for the parse, which only finds where each element ends; each block is also checked to be
    UTF-8, as the rows are decoded when they are read. A malformed element is the whole file's
    error, named by line and column as ``json.loads`` names it.
    """
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    text, base, eof = "", 0, False  # text: the file's bytes from offset base, one char per byte
    newlines, last_newline = 0, -1  # in the bytes before base: count, and offset of the last one
    starts, sizes = [], []

    def more() -> None:
        nonlocal text, eof
        block = f.read(BLOCK)
        if bar is not None:
            bar.update(len(block))
        eof = not block
        pending = len(utf8.getstate()[0])  # the last block's unfinished character, decoded with this one
        try:
            utf8.decode(block, final=eof)  # only the check; the text is dropped
        except UnicodeDecodeError as e:
            raise _NotUtf8(f"{e.reason} at byte {base + len(text) - pending + e.start}") from None
        text = text + block.decode("latin-1") if text else block.decode("latin-1")

    def bad(msg: str, pos: int) -> RowSpans:
        k = text.rfind("\n", 0, pos)
        line = newlines + text.count("\n", 0, pos) + 1
        column = pos - k if k >= 0 else base + pos - last_newline
        return RowSpans.empty(BadSample(Location(name, line=line), "malformed_json", f"column {column}: {msg}"))

    def ws(pos: int) -> int:
        """Past the whitespace at ``pos``, reading on while the text ends in whitespace."""
        while True:
            pos = _JSON_WS.match(text, pos).end()
            if pos < len(text) or eof:
                return pos
            more()

    try:
        more()
        if text.startswith(BOM.decode("latin-1")):  # json.loads of 'utf-8-sig' text: columns after it
            text, base, last_newline = text[len(BOM) :], len(BOM), len(BOM) - 1
        pos = ws(0)
        if text[pos : pos + 1] != "[":
            return _not_an_array(f, name)
        pos = ws(pos + 1)
        if text[pos : pos + 1] == "]":
            pos += 1
        else:
            while True:
                try:
                    _, end = decoder.raw_decode(text, pos)
                    complete = end < len(text) or eof  # a number at the end of the text may go on
                except json.JSONDecodeError as e:
                    if eof:
                        return bad(e.msg, e.pos)
                    complete = False
                if not complete:
                    more()
                    continue
                starts.append(base + pos)
                sizes.append(end - pos)
                pos = ws(end)
                sep = text[pos : pos + 1]
                if sep == "]":
                    pos += 1
                    break
                if sep != ",":
                    return bad("Expecting ',' delimiter", pos)
                pos = ws(pos + 1)
                if pos > BLOCK:  # drop what has been read: the pass holds about two blocks
                    k = text.rfind("\n", 0, pos)
                    if k >= 0:
                        newlines, last_newline = newlines + text.count("\n", 0, pos), base + k
                    text, base, pos = text[pos:], base + pos, 0
        pos = ws(pos)
        if pos < len(text):
            return bad("Extra data", pos)
    except _NotUtf8 as e:
        return RowSpans.empty(BadSample(Location(name), "malformed_json", f"not UTF-8 text ({e})"))
    return RowSpans(np.asarray(starts, np.int64), np.asarray(sizes, np.int32), np.zeros(len(starts), np.int32))


class _NotUtf8(Exception):
    pass


def _not_an_array(f, name: str) -> RowSpans:
    """A file that does not start with ``[``: parsed whole, only to say what it is instead."""
    f.seek(0)
    try:
        data = json.loads(f.read().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        return RowSpans.empty(
            BadSample(Location(name), "malformed_json", f"not UTF-8 text ({e.reason} at byte {e.start})")
        )
    except json.JSONDecodeError as e:
        return RowSpans.empty(BadSample(Location(name, line=e.lineno), "malformed_json", f"column {e.colno}: {e.msg}"))
    return RowSpans.empty(
        BadSample(Location(name), "bad_format", f"top level must be a JSON array of rows, got {type(data).__name__}")
    )


class JsonSource:
    """Rows of one ``.json`` (array) or ``.jsonl`` file, read from the file one row at a time.

    The rows are found on first use (:meth:`find_rows`), not when the source is opened, and
    not at all when the prepared index brings the spans (:meth:`use_spans`): a warm start
    only needs the file's name and ``stat``.
    """

    def __init__(self, path: Path):
        self.path = path
        self.name = str(path)
        self.base_dir = path.parent
        self._spans: RowSpans | None = None

    def find_rows(self, bar: tqdm | None = None) -> None:
        """Find the rows now (before forking processes that would each do it otherwise)."""
        self.spans(bar)

    def spans(self, bar: tqdm | None = None) -> RowSpans:
        if self._spans is None:
            self._spans = RowSpans.find(self.path, bar)
        return self._spans

    def use_spans(self, spans: RowSpans) -> None:
        """The spans found by an earlier pass over this same file (the prepared index's)."""
        self._spans = spans

    @property
    def error(self) -> BadSample | None:
        """The whole file is unreadable (it then has no rows)."""
        return self.spans().error

    def __len__(self) -> int:
        return len(self.spans())

    def location(self, i: int) -> Location:
        line = int(self.spans().line[i])
        return Location(self.name, row=i, line=line or None)

    def row(self, i: int) -> Any:
        """Row ``i``, read from the file and parsed; a JSONL line that does not parse is a bad row."""
        spans = self.spans()
        fd = os.open(self.path, os.O_RDONLY)
        try:
            raw = os.pread(fd, int(spans.size[i]), int(spans.start[i]))
        finally:
            os.close(fd)
        try:
            return json.loads(raw.decode("utf-8-sig" if spans.line[i] == 1 else "utf-8"))
        except UnicodeDecodeError as e:
            raise BadSample(self.location(i), "malformed_json", f"not UTF-8 text ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise BadSample(self.location(i), "malformed_json", f"column {e.colno}: {e.msg}") from None


class HFSource:
    """Rows of a ``datasets.Dataset``, read as Arrow so images stay undecoded bytes."""

    def __init__(self, dataset, name: str, base_dir: Path | None):
        self.name = name
        self.base_dir = base_dir
        self.error: BadSample | None = None
        self.fingerprint: str = dataset._fingerprint  # datasets' own hash of its files and transforms
        self._arrow = dataset.with_format("arrow")
        self._len = len(dataset)

    def __len__(self) -> int:
        return self._len

    def find_rows(self, bar: tqdm | None = None) -> None:
        """Nothing to do: Arrow tables are memory-mapped."""

    def location(self, i: int) -> Location:
        return Location(self.name, row=i)

    def row(self, i: int) -> dict:
        return self._arrow[i : i + 1].to_pylist()[0]


# ---------------------------------------------------------------------------------------------
# Finding the rows of many files; the spans in the prepared index


def _find(path: Path) -> RowSpans:
    return RowSpans.find(path)


def find_rows(sources: list, num_proc: int = 1, progress: bool = False) -> None:
    """Find the rows of every JSON source that has no spans yet, ``num_proc`` files at a time.

    ``progress``: a bar over the files' bytes on stderr (``qwenkit data prepare``)."""
    todo = [s for s in sources if isinstance(s, JsonSource) and s._spans is None]
    if not todo:
        return
    with tqdm(
        total=sum(s.path.stat().st_size for s in todo), unit="B", unit_scale=True, desc="rows", disable=not progress
    ) as bar:
        if num_proc <= 1 or len(todo) < 2:
            for source in todo:
                source.find_rows(bar)
            return
        with multiprocessing.get_context("fork").Pool(num_proc) as pool:
            for source, spans in zip(todo, pool.imap(_find, [s.path for s in todo])):
                source.use_spans(spans)
                bar.update(source.path.stat().st_size)


SPAN_ARRAYS = ("rows_count", "rows_start", "rows_size", "rows_line")  # their names in the index file


def spans_arrays(sources: list) -> dict[str, np.ndarray]:
    """The JSON sources' spans as flat arrays (``rows_count [S]``: -1 for a source without spans).

    A file-level error is not kept here: the index records it as a bad entry."""
    spans = [s.spans() if isinstance(s, JsonSource) else None for s in sources]
    kept = [s for s in spans if s is not None] or [RowSpans.empty()]
    return {
        "rows_count": np.asarray([-1 if s is None else len(s) for s in spans], np.int64),
        "rows_start": np.concatenate([s.start for s in kept]),
        "rows_size": np.concatenate([s.size for s in kept]),
        "rows_line": np.concatenate([s.line for s in kept]),
    }


def use_spans(sources: list, arrays: dict[str, np.ndarray]) -> None:
    """Hand each JSON source its spans from :func:`spans_arrays`'s arrays (no pass over the files)."""
    at = 0
    for source, n in zip(sources, arrays["rows_count"].tolist()):
        if n < 0:
            continue
        cut = slice(at, at + n)
        source.use_spans(RowSpans(arrays["rows_start"][cut], arrays["rows_size"][cut], arrays["rows_line"][cut]))
        at += n


def open_sources(data) -> list[JsonSource | HFSource]:
    """Every source behind ``data``: a path (file or directory) or a ``datasets.Dataset``."""
    if not isinstance(data, (str, Path)):
        if not _is_hf_dataset(data):
            raise DataError(f"data must be a path or a datasets.Dataset, got {type(data).__name__}")
        name = getattr(data.info, "dataset_name", None) or "in-memory"
        return [HFSource(data, f"<datasets.Dataset {name}>", None)]
    path = Path(data).expanduser()
    if path.is_file():
        if path.suffix in (".json", ".jsonl"):
            return [JsonSource(path)]
        if path.suffix in HF_FILE_BUILDERS:
            return [_hf_load(path, HF_FILE_BUILDERS[path.suffix], data_files=str(path))]
        raise DataError(
            f"data.path={str(data)!r}: unsupported file type {path.suffix!r}; "
            f"use .json, .jsonl, {', '.join(HF_FILE_BUILDERS)} or a directory"
        )
    if not path.is_dir():
        raise DataError(f"data.path={str(data)!r}: no such file or directory")
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        datasets = _import_datasets(data)
        return [HFSource(datasets.load_from_disk(str(path)), str(path), path)]
    files = json_files(path)
    if files:
        return [JsonSource(p) for p in files]
    if not any(p.suffix in HF_FILE_BUILDERS for p in path.rglob("*")):
        raise DataError(
            f"data.path={str(data)!r}: no .json/.jsonl files, no save_to_disk dataset and no "
            f"{'/'.join(HF_FILE_BUILDERS)} files in this directory"
        )
    return [_hf_load(path, str(path))]


def json_files(path: Path) -> list[Path]:
    """The ``.json``/``.jsonl`` data files under directory ``path`` (not datasets' metadata, not hidden), sorted."""
    return sorted(
        p
        for p in path.rglob("*")
        if p.suffix in (".json", ".jsonl")
        and p.is_file()
        and p.name not in METADATA_FILES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )


def _is_hf_dataset(data) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(data, datasets.Dataset)


def _hf_load(path: Path, builder: str, data_files: str | None = None) -> HFSource:
    datasets = _import_datasets(path)
    loaded = datasets.load_dataset(builder, data_files=data_files)
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(loaded) == 1:
            loaded = next(iter(loaded.values()))
        else:
            raise DataError(f"data.path={str(path)!r}: several splits {list(loaded)} and none named 'train'")
    return HFSource(loaded, str(path), path if path.is_dir() else path.parent)


def _import_datasets(path):
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"data.path={str(path)!r} is a Hugging Face dataset; install the 'datasets' extra "
            "(pip install 'qwenkit[datasets]')"
        ) from None
    return datasets
