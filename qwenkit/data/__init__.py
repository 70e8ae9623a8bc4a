"""The data pipeline: rows → checked conversations → qwen2vl tokens → padded or packed micro-batches.

:func:`build` is the one entry point a training run uses::

    bundle = data.build(cfg, processor, rank, world_size)
    for batch in bundle.batches():  # endless; bundle.sampler.state_dict() resumes after it
        ...

Modules: :mod:`.pipeline` (``build``: dataset, sampler choice, collator, eval set; ``DataBundle``),
:mod:`.load` (sources, the cached or scanned index, the bad-sample policy), :mod:`.split` (the
held-out split), :mod:`.reader` (files and HF datasets), :mod:`.layouts` (public dataset layouts),
:mod:`.layout_survey` (the layouts a dataset holds), :mod:`.conversation` (row layout, roles, turns), :mod:`.images` (image entries, decoding, grids),
:mod:`.video` (video decoding, frame sampling), :mod:`.template` (qwen2vl tokens and labels),
:mod:`.dataset` (scan and lazy encoding), :mod:`.index` (the index as arrays), :mod:`.cache`
(fingerprint, parallel cold scan, cache file), :mod:`.collator`, :mod:`.sampler`, :mod:`.report`
(bad-sample reasons and counts), :mod:`.check` (``qwenkit data check``), :mod:`.prepare`
(``qwenkit data prepare``). Bad samples met only when a sample is loaded follow the same
policy (see :mod:`.dataset`).
"""

from __future__ import annotations

from qwenkit.data.collator import Collator
from qwenkit.data.dataset import EncodedDataset
from qwenkit.data.load import open_dataset, read_checked, read_dataset
from qwenkit.data.pipeline import DataBundle, build, make_sampler
from qwenkit.data.reader import DataError
from qwenkit.data.report import REASONS, BadSample, BadSampleReport
from qwenkit.data.sampler import FixedSizeSampler, TokenBudgetSampler
from qwenkit.data.split import EVAL_SPLIT_STREAM, split_eval

__all__ = [
    "EVAL_SPLIT_STREAM",
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
    "make_sampler",
    "open_dataset",
    "read_checked",
    "read_dataset",
    "split_eval",
]
