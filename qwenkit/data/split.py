"""The held-out split of ``data.eval_fraction``: disjoint, in file order, the same on every rank."""

from __future__ import annotations

import numpy as np

from qwenkit.data.dataset import EncodedDataset

# Another stream of train.seed than the sampler's epochs use, so the split and the order are independent.
EVAL_SPLIT_STREAM = 2**32 - 1


def held_out(n: int, fraction: float) -> int:
    """How many of ``n`` rows :func:`split_eval` holds out: ``round(fraction * n)``, at least 1 (the
    rows left, ``n - held_out(n, f)``, never fall as ``n`` grows: the launcher's count bounds them)."""
    return max(1, round(fraction * n))


def split_eval(dataset: EncodedDataset, fraction: float, seed: int) -> tuple[EncodedDataset, EncodedDataset]:
    """``(train, eval)``: ``round(fraction * n)`` rows (at least 1) held out, chosen by ``seed``.

    The two are disjoint sets of the scanned rows; both keep file order, and the split depends
    only on the rows that passed the scan, the fraction and the seed (the same on every rank).
    """
    n = len(dataset)
    k = held_out(n, fraction)
    if k >= n:
        raise ValueError(f"data.eval_fraction={fraction} holds out {k} of {n} rows: nothing is left to train on")
    order = np.random.default_rng([seed % 2**64, EVAL_SPLIT_STREAM]).permutation(n)
    return dataset.subset(sorted(order[k:].tolist())), dataset.subset(sorted(order[:k].tolist()))
