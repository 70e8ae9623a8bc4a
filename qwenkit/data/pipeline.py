"""A training run's data: the dataset, its sampler, collator and eval set, built once per rank (:func:`build`)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from qwenkit.config import OBJECTIVES, Config
from qwenkit.data.collator import Collator
from qwenkit.data.dataset import EncodedDataset
from qwenkit.data.load import read_checked, read_dataset
from qwenkit.data.preference import PairCollator, PairDataset
from qwenkit.data.reader import DataError
from qwenkit.data.report import BadSampleReport
from qwenkit.data.sampler import FixedSizeSampler, TokenBudgetSampler, too_small
from qwenkit.data.split import split_eval
from qwenkit.model.processor import Processor
from qwenkit.model.tiny.data import EVAL_SEED, ensure_dataset

log = logging.getLogger("qwenkit.data")  # the package's logger, as before the split


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
            source.find_rows()  # here, once, not in every worker the DataLoader forks
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


def build(cfg: Config, processor: Processor, rank: int = 0, world_size: int = 1, source=None) -> DataBundle:
    """Dataset, sampler, collator and bad-sample report for this rank, checked before training.

    Raises :class:`qwenkit.data.report.BadSample` (``on_bad_sample=error``) or ``ValueError`` (too many skipped,
    an unparseable file, fewer samples than one step takes: :func:`step_problem`).
    """
    data, reads = cfg.data, OBJECTIVES[cfg.train.objective].reads
    dataset, report = read_checked(data, processor, source, rank, world_size, reads)
    origin = dataset.index_origin
    dataset, eval_dataset = _eval_set(cfg, processor, dataset, rank, world_size, source)
    collator = Collator(processor, data.packing)
    if reads == "pairs":  # one sampler index per pair: a pair is never split across micro-batches or ranks
        dataset, collator = PairDataset(dataset), PairCollator(processor, data.packing)
        eval_dataset = PairDataset(eval_dataset) if eval_dataset is not None else None
    if rank == 0:
        log.info("data: %d %s from %s (%d skipped); %s", len(dataset), report.unit,
                 data.path if source is None else source, report.skipped, origin)  # fmt: skip
    return DataBundle(
        dataset, make_sampler(cfg, dataset, rank, world_size), collator, report, data.num_workers, eval_dataset
    )


UNITS = {"conversations": "samples", "pairs": "pairs", "prompts": "prompts"}  # a sampler index, by what the rows are


def data_parallel(cfg: Config, rank: int, world_size: int) -> tuple[int, int]:
    """``(rank, size)`` among the data-parallel ranks: the ranks of a sequence-parallel group share
    their micro-batch (:func:`qwenkit.distributed.sequence.init_groups`' groups of consecutive ranks)."""
    sp = cfg.parallel.sp_size
    return rank // sp, max(world_size // sp, 1)


def _step(cfg: Config, world_size: int) -> tuple[int | None, int, int]:
    """A step's micro-batches as :func:`qwenkit.data.sampler.too_small` takes them: ``(samples per
    micro-batch, None under a token budget; data-parallel ranks; train.grad_accum)``."""
    per = None if cfg.data.max_tokens_per_batch else cfg.train.micro_batch_size
    return per, data_parallel(cfg, 0, world_size)[1], cfg.train.grad_accum


def step_samples(cfg: Config, world_size: int) -> int:
    """The fewest samples one optimizer step of this run on ``world_size`` ranks takes."""
    per, ranks, accum = _step(cfg, world_size)
    return (per or 1) * ranks * accum


def step_problem(cfg: Config, num_samples: int, world_size: int, what: str | None = None) -> str | None:
    """Why ``num_samples`` cannot fill one optimizer step of this run on ``world_size`` ranks, or None:
    :func:`qwenkit.data.sampler.too_small` with the run's micro-batches. Asked by :func:`make_sampler` in
    every rank and by the launcher before any rank starts (:mod:`qwenkit.engine.run.prespawn`, with ``what``
    naming its count)."""
    return too_small(num_samples, *_step(cfg, world_size), UNITS[OBJECTIVES[cfg.train.objective].reads], what)


def make_sampler(cfg: Config, dataset: EncodedDataset, rank: int, world_size: int) -> FixedSizeSampler:
    """A fixed ``train.micro_batch_size``, or micro-batches filled to ``data.max_tokens_per_batch``, dealt
    over the data-parallel ranks (:func:`data_parallel`). Raises a :class:`~qwenkit.data.reader.DataError`
    when the dataset cannot fill one step (:func:`step_problem`): one line, as a bad dataset is."""
    if problem := step_problem(cfg, len(dataset), world_size):
        raise DataError(problem)
    data, accum = cfg.data, cfg.train.grad_accum  # epochs end at a step's end (see qwenkit.data.sampler)
    rank, world_size = data_parallel(cfg, rank, world_size)
    if data.max_tokens_per_batch:
        return TokenBudgetSampler(
            dataset.lengths, data.max_tokens_per_batch, cfg.train.seed, data.shuffle, rank, world_size, data.packing,
            accum=accum,
        )
    return FixedSizeSampler(len(dataset), cfg.train.micro_batch_size, cfg.train.seed, data.shuffle, rank, world_size,
                            accum, unit=UNITS[OBJECTIVES[cfg.train.objective].reads])  # fmt: skip


def _eval_set(cfg: Config, processor: Processor, dataset: EncodedDataset, rank: int, world_size: int, source):
    """``(train rows, eval rows or None)`` from data.eval_path, data.eval_fraction or data.tiny_eval_samples."""
    data, reads = cfg.data, OBJECTIVES[cfg.train.objective].reads
    if data.eval_fraction > 0:
        dataset, held_out = split_eval(dataset, data.eval_fraction, cfg.train.seed)
        where = f"{data.eval_fraction:g} of data.path held out (train.seed={cfg.train.seed})"
    elif data.eval_path is not None:
        held_out, _ = read_checked(data, processor, data.eval_path, rank, world_size, reads)
        where = data.eval_path
    elif data.tiny_eval_samples > 0 and source is None and data.path == "tiny":
        eval_rows = ensure_dataset(data.tiny_eval_samples, seed=EVAL_SEED, preference=reads == "pairs", task=data.tiny_task)
        held_out, _ = read_dataset(data, processor, eval_rows, rank=rank, world_size=world_size, reads=reads)
        where = f"synthetic, seed {EVAL_SEED}"
    else:
        return dataset, None
    if len(held_out) == 0:
        raise ValueError(f"the eval set ({where}) has no usable rows")
    if rank == 0:
        log.info("eval data: %d samples (%s); training on %d", len(held_out), where, len(dataset))
    return dataset, held_out
