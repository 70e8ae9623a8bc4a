"""The data pipeline: rows → checked conversations → qwen2vl tokens → padded micro-batches.

:func:`build` is the one entry point a training run uses::

    bundle = data.build(cfg, processor, rank, world_size)
    for batch in bundle.batches():  # endless; bundle.sampler.state_dict() resumes after it
        ...

Bad-sample policy (``data.on_bad_sample``): ``error`` stops at the first bad row with its
file, row and reason; ``skip`` drops bad rows, logs them with their reasons, and fails only if
more than ``data.max_bad_fraction`` of the rows are bad. A JSON file that does not parse at all
is never skipped: how many rows it held is unknown.

Modules: :mod:`.reader` (files and HF datasets), :mod:`.conversation` (row layout, roles,
turns), :mod:`.images` (image entries, decoding, grids), :mod:`.template` (qwen2vl tokens and
labels), :mod:`.dataset` (scan and lazy encoding), :mod:`.collator`, :mod:`.sampler`,
:mod:`.report` (bad-sample reasons and counts), :mod:`.check` (``qwenkit data check``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from qwenkit.config import Config, DataConfig
from qwenkit.data.collator import Collator
from qwenkit.data.dataset import EncodedDataset, scan
from qwenkit.data.reader import DataError, open_sources
from qwenkit.data.report import REASONS, BadSample, BadSampleReport
from qwenkit.data.sampler import ResumableSampler
from qwenkit.processor import Processor
from qwenkit.tiny import ensure_dataset

__all__ = [
    "REASONS",
    "BadSample",
    "BadSampleReport",
    "Collator",
    "DataBundle",
    "DataError",
    "EncodedDataset",
    "ResumableSampler",
    "build",
    "read_dataset",
    "sample_batches",
    "text_only",
    "to_device",
]

log = logging.getLogger(__name__)


@dataclass
class DataBundle:
    dataset: EncodedDataset
    sampler: ResumableSampler
    collator: Collator
    report: BadSampleReport
    num_workers: int = 0

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Endless collated micro-batches for this rank, from the sampler's position on.

        The sampler's position moves as each batch is handed out (not when a DataLoader worker
        prefetches it), so ``sampler.state_dict()`` taken between two batches resumes at the next.
        """
        if self.num_workers == 0:
            for indices in self.sampler:
                yield self.collator([self.dataset[i] for i in indices])
            return
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


def read_dataset(data: DataConfig, processor: Processor, source=None, stop_at_first: bool = False):
    """Scan a dataset: ``(EncodedDataset, BadSampleReport)``; ``source`` overrides ``data.path``.

    ``source`` may be a path or a ``datasets.Dataset``; ``"tiny"`` is the embedded synthetic set.
    """
    source = data.path if source is None else source
    if isinstance(source, str) and source == "tiny":
        source = ensure_dataset(data.tiny_samples, seed=0)
    return scan(open_sources(source), processor, data, stop_at_first)


def build(cfg: Config, processor: Processor, rank: int = 0, world_size: int = 1, source=None) -> DataBundle:
    """Dataset, sampler, collator and bad-sample report for this rank, checked before training.

    Raises :class:`BadSample` (``on_bad_sample=error``) or ``ValueError`` (too many skipped,
    an unparseable file, fewer samples than one global batch).
    """
    data = cfg.data
    dataset, report = read_dataset(data, processor, source, stop_at_first=data.on_bad_sample == "error")
    unreadable = [str(s.error) for s in dataset.sources if s.error is not None]
    if unreadable:
        raise ValueError(
            "unreadable dataset files cannot be skipped (the number of rows lost is unknown):\n  "
            + "\n  ".join(unreadable)
        )
    if rank == 0:
        report.log()
        log.info(
            "data: %d samples from %s (%d skipped)",
            len(dataset),
            data.path if source is None else source,
            report.skipped,
        )
    report.check_fraction(data.max_bad_fraction)
    sampler = ResumableSampler(
        len(dataset), cfg.train.micro_batch_size, cfg.train.seed, data.shuffle, rank, world_size
    )
    return DataBundle(dataset, sampler, Collator(processor), report, data.num_workers)


# ---------------------------------------------------------------------------------------------
# Fixed batches for measurements (notebooks 03 and 04, tests): no sampler, no shuffling


def text_only(sample: dict[str, torch.Tensor], processor: Processor) -> dict[str, torch.Tensor]:
    """The sample without its vision spans (start, pad and end tokens) and pixels."""
    vision = torch.tensor([processor.vision_start_id, processor.image_token_id, processor.vision_end_id])
    keep = ~torch.isin(sample["input_ids"], vision)  # [S]
    return {k: v[keep] for k, v in sample.items() if k in ("input_ids", "labels", "mm_token_type_ids")}


def sample_batches(
    cfg: Config, processor: Processor, count: int, batch_size: int, text: bool = False
) -> list[dict[str, torch.Tensor]]:
    """``count`` collated batches of ``batch_size`` consecutive samples of ``cfg.data.path``.

    ``text``: the same samples with their vision spans removed (:func:`text_only`). The batches
    carry no ``num_items``/``num_samples``: the model counts a lone batch itself.
    """
    dataset, _ = read_dataset(cfg.data, processor)
    if len(dataset) == 0:
        raise ValueError(f"data.path={cfg.data.path!r} has no usable samples")
    collate = Collator(processor)
    out = []
    for b in range(count):
        samples = [dataset[(b * batch_size + i) % len(dataset)] for i in range(batch_size)]
        if text:
            samples = [text_only(s, processor) for s in samples]
        batch = collate(samples)
        del batch["num_items"], batch["num_samples"]
        out.append(batch)
    return out


def to_device(batch: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``batch`` on ``device``, its floating-point tensors (pixels) in ``dtype``."""
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in batch.items()}
