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

import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from qwenkit.data.report import BadSample, Location
from qwenkit.data.row_spans import RowSpans

# LLaMA-Factory and HF keep metadata next to the data under this name; it is not data.
METADATA_FILES = {"dataset_info.json", "state.json"}
HF_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow"}


class DataError(ValueError):
    """The dataset cannot be read at all (wrong path, unsupported format, no rows)."""


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
