"""The data pipeline: rows → checked conversations → qwen2vl tokens → padded or packed micro-batches.

:func:`build` is the one entry point a training run uses::

    bundle = data.build(cfg, processor, rank, world_size)
    for batch in bundle.batches():  # endless; bundle.sampler.state_dict() resumes after it
        ...

Bad-sample policy (``data.on_bad_sample``): ``error`` stops at the first bad row with its
file, row and reason; ``skip`` drops bad rows, logs them with their reasons, and fails only if
more than ``data.max_bad_fraction`` of the rows are bad. A JSON file that does not parse at all
is never skipped: how many rows it held is unknown.

The scan's result is a prepared index cached under ``data.cache_dir`` (:mod:`.cache`): a
start with the same data files, processor and encoding settings reads it instead of scanning.
Bad samples met only when a sample is loaded follow the same policy (see :mod:`.dataset`).

Modules: :mod:`.reader` (files and HF datasets), :mod:`.conversation` (row layout, roles,
turns), :mod:`.images` (image entries, decoding, grids), :mod:`.template` (qwen2vl tokens and
labels), :mod:`.dataset` (scan and lazy encoding), :mod:`.index` (the index as arrays),
:mod:`.cache` (fingerprint, parallel cold scan, cache file), :mod:`.collator`, :mod:`.sampler`,
:mod:`.report` (bad-sample reasons and counts), :mod:`.check` (``qwenkit data check``),
:mod:`.prepare` (``qwenkit data prepare``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from qwenkit.config import Config, DataConfig
from qwenkit.data import cache
from qwenkit.data.collator import Collator
from qwenkit.data.dataset import EncodedDataset
from qwenkit.data.preference import PairCollator, PairDataset, preference_data, preference_sources
from qwenkit.data.reader import DataError, open_sources
from qwenkit.data.report import REASONS, BadSample, BadSampleReport
from qwenkit.data.sampler import FixedSizeSampler, TokenBudgetSampler
from qwenkit.model.processor import Processor
from qwenkit.model.tiny import EVAL_SEED, ensure_dataset

__all__ = [
    "REASONS",
    "BadSample",
    "BadSampleReport",
    "Collator",
    "DataBundle",
    "DataError",
    "EncodedDataset",
    "FixedSizeSampler",
    "TokenBudgetSampler",
    "build",
    "open_dataset",
    "read_checked",
    "read_dataset",
    "split_eval",
]

# Another stream of train.seed than the sampler's epochs use, so the split and the order are independent.
EVAL_SPLIT_STREAM = 2**32 - 1

log = logging.getLogger(__name__)


@dataclass
class DataBundle:
    dataset: EncodedDataset
    sampler: FixedSizeSampler
    collator: Collator
    report: BadSampleReport
    num_workers: int = 0
    eval_dataset: EncodedDataset | None = None  # held-out rows (data.eval_path, eval_fraction, tiny_eval_samples)

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Endless collated micro-batches for this rank, from the sampler's position on.

        The sampler's position moves as each batch is handed out (not when a DataLoader worker
        prefetches it), so ``sampler.state_dict()`` taken between two batches resumes at the next.
        """
        if self.num_workers == 0:
            for indices in self.sampler:
                yield self.collator([self.dataset[i] for i in indices])
            return
        for source in self.dataset.sources:
            source.parse()  # here, once, not in every worker the DataLoader forks
        positions, plan = itertools.tee(self.sampler.plan())
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=(indices for _, _, indices in plan),
            collate_fn=self.collator,
            num_workers=self.num_workers,
        )
        for (epoch, batch, _), collated in zip(positions, loader):
            self.sampler.advance_past(epoch, batch)
            yield collated


def open_dataset(data: DataConfig, source=None, pairs: bool = False) -> list:
    """The sources of ``source`` (default ``data.path``; ``"tiny"`` is the embedded synthetic set).

    ``source`` may be a path or a ``datasets.Dataset``; ``pairs``: read as preference pairs
    (:mod:`.preference`), two rows per row.
    """
    source = data.path if source is None else source
    if isinstance(source, str) and source == "tiny":
        source = ensure_dataset(data.tiny_samples, seed=0, preference=pairs)
    return preference_sources(open_sources(source)) if pairs else open_sources(source)


def read_dataset(
    data: DataConfig,
    processor: Processor,
    source=None,
    stop_at_first: bool = False,
    rank: int = 0,
    world_size: int = 1,
    use_cache: bool = True,
    pairs: bool = False,
):
    """A dataset's index, from the cache or scanned: ``(EncodedDataset, BadSampleReport)``.

    ``source`` overrides ``data.path`` (see :func:`open_dataset`); ``stop_at_first`` raises the
    first bad row (in file and row order) as a :class:`BadSample`. ``dataset.index_origin``
    says whether the index came from the cache.
    """
    sources = open_dataset(data, source, pairs)
    if pairs:
        data = preference_data(data)
    prepared = cache.prepare(sources, processor, data, rank, world_size, use_cache)
    index = prepared.index
    if stop_at_first and index.bad:
        raise index.bad[0].error()
    dataset = EncodedDataset(sources, index, processor, data, prepared.origin)
    return dataset, index.report()


def read_checked(data: DataConfig, processor: Processor, source=None, rank: int = 0, world_size: int = 1, pairs=False):
    """``read_dataset`` under the bad-sample policy: ``(EncodedDataset, BadSampleReport)``.

    ``on_bad_sample=error`` raises the first bad row; an unreadable file is never skipped; the
    skipped rows are logged (rank 0) and more than ``data.max_bad_fraction`` of them raise. The
    training set, ``data.eval_path`` and ``qwenkit eval --data`` all pass through here.
    """
    dataset, report = read_dataset(
        data, processor, source, stop_at_first=data.on_bad_sample == "error", rank=rank, world_size=world_size,
        pairs=pairs,
    )
    unreadable = [str(b.error()) for b in dataset.index.bad if b.row is None]
    if unreadable:
        raise DataError(
            "unreadable dataset files cannot be skipped (the number of rows lost is unknown):\n  "
            + "\n  ".join(unreadable)
        )
    if rank == 0:
        report.log()
    report.check_fraction(data.max_bad_fraction)
    return dataset, report


def build(cfg: Config, processor: Processor, rank: int = 0, world_size: int = 1, source=None) -> DataBundle:
    """Dataset, sampler, collator and bad-sample report for this rank, checked before training.

    Raises :class:`BadSample` (``on_bad_sample=error``) or ``ValueError`` (too many skipped,
    an unparseable file, fewer samples than one global batch).
    """
    data, pairs = cfg.data, cfg.train.objective == "dpo"
    dataset, report = read_checked(data, processor, source, rank, world_size, pairs)
    if rank == 0:
        log.info(
            "data: %d samples from %s (%d skipped); %s",
            len(dataset),
            data.path if source is None else source,
            report.skipped,
            dataset.index_origin,
        )
    dataset, eval_dataset = _eval_set(cfg, processor, dataset, rank, world_size, source)
    collator = Collator(processor, data.packing)
    if pairs:  # one sampler index per pair: a pair is never split across micro-batches or ranks
        dataset, collator = PairDataset(dataset), PairCollator(processor)
        eval_dataset = PairDataset(eval_dataset) if eval_dataset is not None else None
        if rank == 0:
            log.info("preference pairs: %d (both sides passed the scan)", len(dataset))
    return DataBundle(
        dataset, make_sampler(cfg, dataset, rank, world_size), collator, report, data.num_workers, eval_dataset
    )


def make_sampler(cfg: Config, dataset: EncodedDataset, rank: int, world_size: int) -> FixedSizeSampler:
    """A fixed ``train.micro_batch_size``, or micro-batches filled to ``data.max_tokens_per_batch``."""
    data = cfg.data
    if data.max_tokens_per_batch:
        return TokenBudgetSampler(
            dataset.lengths, data.max_tokens_per_batch, cfg.train.seed, data.shuffle, rank, world_size, data.packing
        )
    return FixedSizeSampler(len(dataset), cfg.train.micro_batch_size, cfg.train.seed, data.shuffle, rank, world_size)


def split_eval(dataset: EncodedDataset, fraction: float, seed: int) -> tuple[EncodedDataset, EncodedDataset]:
    """``(train, eval)``: ``round(fraction * n)`` rows (at least 1) held out, chosen by ``seed``.

    The two are disjoint sets of the scanned rows; both keep file order, and the split depends
    only on the rows that passed the scan, the fraction and the seed (the same on every rank).
    """
    n = len(dataset)
    k = max(1, round(fraction * n))
    if k >= n:
        raise ValueError(f"data.eval_fraction={fraction} holds out {k} of {n} rows: nothing is left to train on")
    order = np.random.default_rng([seed % 2**64, EVAL_SPLIT_STREAM]).permutation(n)
    return dataset.subset(sorted(order[k:].tolist())), dataset.subset(sorted(order[:k].tolist()))


def _eval_set(cfg: Config, processor: Processor, dataset: EncodedDataset, rank: int, world_size: int, source):
    """``(train rows, eval rows or None)`` from data.eval_path, data.eval_fraction or data.tiny_eval_samples."""
    data, pairs = cfg.data, cfg.train.objective == "dpo"
    if data.eval_fraction > 0:
        dataset, held_out = split_eval(dataset, data.eval_fraction, cfg.train.seed)
        where = f"{data.eval_fraction:g} of data.path held out (train.seed={cfg.train.seed})"
    elif data.eval_path is not None:
        held_out, _ = read_checked(data, processor, data.eval_path, rank, world_size, pairs)
        where = data.eval_path
    elif data.tiny_eval_samples > 0 and source is None and data.path == "tiny":
        eval_rows = ensure_dataset(data.tiny_eval_samples, seed=EVAL_SEED, preference=pairs)
        held_out, _ = read_dataset(data, processor, eval_rows, rank=rank, world_size=world_size, pairs=pairs)
        where = f"synthetic, seed {EVAL_SEED}"
    else:
        return dataset, None
    if len(held_out) == 0:
        raise ValueError(f"the eval set ({where}) has no usable rows")
    if rank == 0:
        log.info("eval data: %d samples (%s); training on %d", len(held_out), where, len(dataset))
    return dataset, held_out

