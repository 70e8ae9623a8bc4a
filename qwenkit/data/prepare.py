"""``qwenkit data prepare PATH``: build a dataset's index cache ahead of training.

Run it where CPUs are cheap (a CPU node, the login node) with the run's ``--config``: it scans
with ``data.num_proc`` processes (``--num-proc`` overrides) and writes the index training will
look for, under the same fingerprint (:mod:`qwenkit.data.cache`; rows read as ``train.objective``
reads them: preference pairs, GRPO's prompts). Training on GPUs then starts
from the cache. Exit status: 0 when the index is there (bad rows included; ``data check`` lists
them), 2 when the dataset or the config cannot be read.
"""

from __future__ import annotations

import sys

from qwenkit import config as qconfig
from qwenkit.data import read_dataset
from qwenkit.data.reader import DataError
from qwenkit.model.paths import load_processor, resolve_path


def prepare(cfg: qconfig.Config) -> int:
    """``qwenkit data prepare``: write ``cfg.data.path``'s index; returns the command's exit status."""
    try:
        processor = load_processor(cfg, resolve_path(cfg.model))
        reads = qconfig.OBJECTIVES[cfg.train.objective].reads
        dataset, _ = read_dataset(cfg.data, processor, reads=reads, progress=True)
    except (DataError, FileNotFoundError) as e:
        print(f"qwenkit data prepare: {e}", file=sys.stderr)
        return 2
    index = dataset.index
    print(f"dataset: {cfg.data.path}")
    print(dataset.index_origin)
    print(
        f"rows: {index.total} read, {len(index)} good, {len(index.bad)} bad; "
        f"index {index.bytes_per_row():.0f} bytes per good row"
    )
    return 0
