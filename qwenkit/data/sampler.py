"""A rank's micro-batches of sample indices, epoch after epoch, with a position that survives a resume.

Epoch ``e`` orders all samples by a permutation seeded with ``(seed, e)`` (or keeps file
order with ``shuffle=False``), the same on every rank. Global batch ``k`` is the slice
``order[k*G : (k+1)*G]`` with ``G = batch_size * world_size``; rank ``r`` takes its
``batch_size`` rows ``r*batch_size ...``. So the union of the ranks' batch ``k`` equals a
single process's batch ``k`` with ``batch_size * world_size`` rows, and every rank gets the
same number of batches per epoch (the ragged tail is dropped).

The position is ``(epoch, batch)``: the next batch to hand out. Because each epoch's order is
a pure function of the seed, ``state_dict()`` is a few integers, and restoring it continues
with exactly the batches an uninterrupted run would have produced.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class ResumableSampler:
    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if num_samples < batch_size * world_size:
            raise ValueError(
                f"the dataset has {num_samples} usable samples, fewer than one global batch: "
                f"train.micro_batch_size={batch_size} x world size {world_size} = {batch_size * world_size}"
            )
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.batch = 0
        self._cached: tuple[int, list[list[int]]] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // (self.batch_size * self.world_size)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of epoch ``epoch``, in order."""
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed % 2**64, epoch])  # SeedSequence wants seeds >= 0
                order = rng.permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            g, b = self.batch_size * self.world_size, self.batch_size
            start = self.rank * b
            batches = [
                order[k * g + start : k * g + start + b].tolist() for k in range(self.batches_per_epoch)
            ]
            self._cached = (epoch, batches)
        return self._cached[1]

    def plan(self) -> Iterator[tuple[int, int, list[int]]]:
        """Endless ``(epoch, batch, indices)`` from the current position; does not move it."""
        epoch, batch = self.epoch, self.batch
        while True:
            if batch >= self.batches_per_epoch:
                epoch, batch = epoch + 1, 0
            yield epoch, batch, self.epoch_batches(epoch)[batch]
            batch += 1

    def advance_past(self, epoch: int, batch: int) -> None:
        """Record that batch ``batch`` of ``epoch`` has been handed out."""
        self.epoch, self.batch = epoch, batch + 1

    def __iter__(self) -> Iterator[list[int]]:
        """Endless batches of indices, moving the position as each is handed out."""
        for epoch, batch, indices in self.plan():
            self.advance_past(epoch, batch)
            yield indices

    def state_dict(self) -> dict:
        """JSON-able; the same on every rank (the rank is not part of it)."""
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by :meth:`state_dict`; the data layout must be the same."""
        mine = self.state_dict()
        wrong = [
            f"{key}: saved {state.get(key)!r}, now {mine[key]!r}"
            for key in ("seed", "shuffle", "num_samples", "batch_size", "world_size")
            if state.get(key) != mine[key]
        ]
        if wrong:
            raise ValueError(
                "cannot resume the data order: the saved sampler state does not match this run ("
                + "; ".join(wrong)
                + "); the same dataset, train.seed, data.shuffle, train.micro_batch_size and world size are needed"
            )
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
