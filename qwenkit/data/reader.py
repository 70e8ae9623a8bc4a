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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qwenkit.data.report import BadSample, Location

# LLaMA-Factory and HF keep metadata next to the data under this name; it is not data.
METADATA_FILES = {"dataset_info.json", "state.json"}
HF_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow"}


class DataError(ValueError):
    """The dataset cannot be read at all (wrong path, unsupported format, no rows)."""


class JsonSource:
    """Rows of one ``.json`` (array) or ``.jsonl`` file.

    The file is parsed on first use, not when the source is opened: a start on a warm index
    cache (:mod:`qwenkit.data.cache`) only needs the file's name and ``stat``, and the rows
    are read when the first sample is.
    """

    def __init__(self, path: Path):
        self.path = path
        self.name = str(path)
        self.base_dir = path.parent
        self._error: BadSample | None = None
        self._rows: list[Any] | None = None
        self._lines: list[int | None] = []

    def parse(self) -> None:
        """Read the file now (before forking workers that would each read it otherwise)."""
        self._parsed()

    def _parsed(self) -> list[Any]:
        if self._rows is None:
            self._rows = []
            if self.path.suffix == ".jsonl":
                self._read_jsonl()
            else:
                self._read_json()
        return self._rows

    @property
    def error(self) -> BadSample | None:
        """The whole file is unreadable (it then has no rows)."""
        self._parsed()
        return self._error

    def _read_json(self) -> None:
        try:
            text = self.path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as e:
            self._error = BadSample(
                Location(self.name), "malformed_json", f"not UTF-8 text ({e.reason} at byte {e.start})"
            )
            return
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            self._error = BadSample(
                Location(self.name, line=e.lineno), "malformed_json", f"column {e.colno}: {e.msg}"
            )
            return
        if not isinstance(data, list):
            self._error = BadSample(
                Location(self.name),
                "bad_format",
                f"top level must be a JSON array of rows, got {type(data).__name__}",
            )
            return
        self._rows = data
        self._lines = [None] * len(data)

    def _read_jsonl(self) -> None:
        for lineno, raw in enumerate(self.path.read_bytes().splitlines(), start=1):
            if not raw.strip():
                continue
            self._lines.append(lineno)
            try:
                self._rows.append(json.loads(raw.decode("utf-8-sig" if lineno == 1 else "utf-8")))
            except UnicodeDecodeError as e:
                self._rows.append(_Malformed(f"not UTF-8 text ({e.reason} at byte {e.start})"))
            except json.JSONDecodeError as e:
                self._rows.append(_Malformed(f"column {e.colno}: {e.msg}"))

    def __len__(self) -> int:
        return len(self._parsed())

    def location(self, i: int) -> Location:
        self._parsed()
        return Location(self.name, row=i, line=self._lines[i])

    def row(self, i: int) -> Any:
        row = self._parsed()[i]
        if isinstance(row, _Malformed):
            raise BadSample(self.location(i), "malformed_json", row.detail)
        return row


class _Malformed:
    def __init__(self, detail: str):
        self.detail = detail


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

    def parse(self) -> None:
        """Nothing to do: Arrow tables are memory-mapped."""

    def location(self, i: int) -> Location:
        return Location(self.name, row=i)

    def row(self, i: int) -> dict:
        return self._arrow[i : i + 1].to_pylist()[0]


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
    files = sorted(
        p
        for p in path.rglob("*")
        if p.suffix in (".json", ".jsonl")
        and p.is_file()
        and p.name not in METADATA_FILES
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if files:
        return [JsonSource(p) for p in files]
    if not any(p.suffix in HF_FILE_BUILDERS for p in path.rglob("*")):
        raise DataError(
            f"data.path={str(data)!r}: no .json/.jsonl files, no save_to_disk dataset and no "
            f"{'/'.join(HF_FILE_BUILDERS)} files in this directory"
        )
    return [_hf_load(path, str(path))]


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
