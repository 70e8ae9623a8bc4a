"""Reading a dataset: its sources, its prepared index (cached or scanned), and the bad-sample policy.

Bad-sample policy (``data.on_bad_sample``): ``error`` stops at the first bad row with its
file, row and reason; ``skip`` drops bad rows, logs them with their reasons, and fails only if
more than ``data.max_bad_fraction`` of the rows are bad. A JSON file that does not parse at all
is never skipped: how many rows it held is unknown (:func:`read_checked`).

The scan's result is a prepared index cached under ``data.cache_dir`` (:mod:`qwenkit.data.cache`):
a start with the same data files, processor and encoding settings reads it instead of scanning.
"""

from __future__ import annotations

from pathlib import Path

from qwenkit.config import DataConfig
from qwenkit.data import cache
from qwenkit.data.dataset import EncodedDataset
from qwenkit.data.index import SampleIndex
from qwenkit.data.preference import index_pairs, pair_report, preference_data, preference_sources
from qwenkit.data.reader import DataError, json_files, open_sources
from qwenkit.data.row_spans import RowSpans
from qwenkit.model.processor import Processor
from qwenkit.model.tiny.data import ensure_dataset


def open_dataset(data: DataConfig, source=None, reads: str = "conversations") -> list:
    """The sources of ``source`` (default ``data.path``; ``"tiny"`` is the embedded synthetic set).

    ``source`` may be a path or a ``datasets.Dataset``; ``reads`` is what the objective's rows are
    (:data:`qwenkit.config.DATA_READS`): ``pairs`` reads preference pairs
    (:mod:`qwenkit.data.preference`), two rows per row.
    """
    source, pairs = _located(data, source, reads), reads == "pairs"
    return preference_sources(open_sources(source)) if pairs else open_sources(source)


def _located(data: DataConfig, source, reads: str):
    """``source`` (default ``data.path``), the ``tiny`` set as the file it is written to."""
    source = data.path if source is None else source
    if isinstance(source, str) and source == "tiny":
        return ensure_dataset(data.tiny_samples, seed=0, preference=reads == "pairs", task=data.tiny_task)
    return source


def index_data(data: DataConfig, reads: str) -> DataConfig:
    """The data settings the index of an objective's rows is cached under: preference pairs' in a
    ``preference/`` sub-folder (a file read as pairs holds twice its rows)."""
    return preference_data(data) if reads == "pairs" else data


def read_dataset(
    data: DataConfig,
    processor: Processor,
    source=None,
    stop_at_first: bool = False,
    rank: int = 0,
    world_size: int = 1,
    use_cache: bool = True,
    reads: str = "conversations",
    progress: bool = False,
):
    """A dataset's index, from the cache or scanned: ``(EncodedDataset, BadSampleReport)``.

    ``source`` overrides ``data.path`` (see :func:`open_dataset`); ``stop_at_first`` raises the
    first bad row (in file and row order) as a :class:`qwenkit.data.report.BadSample`. ``dataset.index_origin``
    says whether the index came from the cache. ``reads``: what the objective's rows are
    (:data:`qwenkit.config.DATA_READS`); ``prompts`` also takes a prompt without a reply when a
    ``solution`` / ``answer`` column is its reference (:func:`qwenkit.data.conversation.parse_row`).
    ``progress``: bars on stderr while the rows are found and scanned.
    """
    sources, data = open_dataset(data, source, reads), index_data(data, reads)
    prompts = reads == "prompts"
    prepared = cache.prepare(sources, processor, data, rank, world_size, use_cache, progress=progress, prompts=prompts)
    index = prepared.index
    if stop_at_first and index.bad:
        raise index.bad[0].error()
    dataset = EncodedDataset(sources, index, processor, data, prepared.origin, prompts)
    return dataset, pair_report(index) if reads == "pairs" else index.report()


def read_checked(data: DataConfig, processor: Processor, source=None, rank: int = 0, world_size: int = 1,
                 reads: str = "conversations"):  # fmt: skip
    """``read_dataset`` under the bad-sample policy: ``(EncodedDataset, BadSampleReport)``.

    ``on_bad_sample=error`` raises the first bad row; an unreadable file is never skipped; the
    skipped rows are logged (rank 0) and more than ``data.max_bad_fraction`` of them raise. The
    training set, ``data.eval_path`` and ``qwenkit eval --data`` all pass through here.
    """
    dataset, report = read_dataset(
        data, processor, source, stop_at_first=data.on_bad_sample == "error", rank=rank, world_size=world_size,
        reads=reads,
    )
    _unreadable(dataset.index)
    if rank == 0:
        report.log()
    report.check_fraction(data.max_bad_fraction)
    return dataset, report


def _unreadable(index) -> None:
    unreadable = [str(b.error()) for b in index.bad if b.row is None]
    if unreadable:
        raise DataError(
            "unreadable dataset files cannot be skipped (the number of rows lost is unknown):\n  "
            + "\n  ".join(unreadable)
        )


def _cached_index(data: DataConfig, processor: Processor, reads: str, source) -> SampleIndex | None:
    """The prepared index of ``source`` read as ``reads``, when the cache holds it (else None: nothing is scanned)."""
    sources, indexed = open_dataset(data, source, reads), index_data(data, reads)
    loaded = SampleIndex.load(cache.index_path(sources, processor, indexed, reads == "prompts"))
    return None if loaded is None else loaded[0]


def cached_problem(data: DataConfig, processor: Processor, reads: str = "conversations", source=None) -> str | None:
    """What :func:`read_checked` would raise in every rank, found before any rank starts, when the
    dataset's index is in the cache already (an earlier start, ``qwenkit data prepare``): the first
    bad row (``on_bad_sample: error``), an unreadable file, more than ``data.max_bad_fraction`` bad
    rows. None when all is well or nothing is cached (the ranks scan and check). ``source``: another
    dataset than ``data.path`` read with the same settings (``data.eval_path``), as :func:`read_checked`'s."""
    index = _cached_index(data, processor, reads, source)
    if index is None:
        return None
    try:
        if data.on_bad_sample == "error" and index.bad:
            raise index.bad[0].error()
        _unreadable(index)
        (pair_report(index) if reads == "pairs" else index.report()).check_fraction(data.max_bad_fraction)
    except ValueError as e:
        return str(e)
    return None


def cached_samples(data: DataConfig, processor: Processor, reads: str = "conversations", source=None) -> int | None:
    """How many samples (pairs, prompts) :func:`read_checked` gives from ``source`` (default ``data.path``),
    when its index is cached: the good rows, or the pairs whose two sides are good. None: nothing cached."""
    index = _cached_index(data, processor, reads, source)
    if index is None:
        return None
    return len(index_pairs(index)) if reads == "pairs" else len(index)


def rows_at_most(data: DataConfig, most: int, reads: str = "conversations", source=None) -> int | None:
    """The rows of the JSON files behind ``source`` (default ``data.path``; ``tiny``: the synthetic set),
    counted up to ``most``: no more of the files is read than holds that many rows, so a large dataset
    costs its first rows only. Every sample (pair, prompt) :func:`read_checked` gives is a row, so fewer
    rows than a step needs is a certain failure the launcher refuses (:mod:`qwenkit.engine.run.prespawn`).
    None: not counted here (a Hugging Face dataset; a file that does not parse, which the ranks name)."""
    source = _located(data, source, reads)
    if not isinstance(source, (str, Path)):
        return None
    path = Path(source).expanduser()
    if path.is_file():
        files = [path] if path.suffix in (".json", ".jsonl") else []
    elif path.is_dir() and not (path / "state.json").is_file():
        files = json_files(path)
    else:
        files = []
    if not files:
        return None
    rows = 0
    for file in files:
        spans = RowSpans.find(file, most=most - rows)
        if spans.error is not None:
            return None
        rows += len(spans)
        if rows >= most:
            return rows
    return rows


def file_sizes(data: DataConfig) -> dict[str, int] | None:
    """The JSON files behind ``data.path`` and their sizes, by name relative to it: what a resume
    compares before any process starts (rows added or removed change every epoch's order), cheap
    (``stat`` only) and the same for a dataset moved or copied elsewhere. None for the ``tiny``
    set and ``datasets`` sources: the ranks check those (rows and their lengths, the sampler state)."""
    if data.path == "tiny":
        return None
    path = Path(data.path).expanduser()
    if path.is_file():
        files = {path.name: path} if path.suffix in (".json", ".jsonl") else {}
    elif path.is_dir() and not (path / "state.json").is_file():
        files = {str(p.relative_to(path)): p for p in json_files(path)}
    else:
        files = {}
    return {name: p.stat().st_size for name, p in files.items()} or None
