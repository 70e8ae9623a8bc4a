"""A rank's micro-batches of sample indices, epoch after epoch, with a global position that survives a resume.

:class:`FixedSizeSampler` takes a fixed number of samples per micro-batch;
:class:`TokenBudgetSampler` (a subclass) fills micro-batches up to a token budget. Both are
stateful and resumable, also on another number of ranks.

Epoch ``e`` orders all samples by a permutation seeded with ``(seed, e)`` (or keeps file
order with ``shuffle=False``), the same on every rank. Global micro-batch ``k`` is the slice
``order[k*G : (k+1)*G]`` with ``G = batch_size * world_size``; rank ``r`` takes its
``batch_size`` rows ``r*batch_size ...``. So the union of the ranks' batch ``k`` equals a
single process's batch ``k`` with ``batch_size * world_size`` rows. An optimizer step takes
``accum`` micro-batches per rank, ``S = G * accum`` samples: an epoch uses the largest multiple
of ``S`` samples (the ragged tail is dropped), so no step straddles two epochs.

The position is **global**: the epoch and the number of its samples handed out (``sample``),
the same on every rank and independent of how they are dealt. Because each epoch's order is a
pure function of the seed, ``state_dict()`` is a few integers, and restoring it continues the
epoch from that sample on: on the same ranks with exactly the batches an uninterrupted run
would have produced; on another number of ranks or another micro-batch size with every
sample of the epoch still seen once, and, when ``S`` (micro-batch x ranks x accumulation) is
kept, with every step taking the same samples as the uninterrupted run.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import numpy as np


class FixedSizeSampler:
    """``batch_size`` samples per micro-batch; stateful and resumable (``state_dict``/``load_state_dict``)."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        accum: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if num_samples < batch_size * world_size * accum:
            raise ValueError(
                f"the dataset has {num_samples} usable samples, fewer than one global batch: "
                f"train.micro_batch_size={batch_size} x world size {world_size} x train.grad_accum={accum} "
                f"= {batch_size * world_size * accum}"
            )
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.rank, self.world_size, self.accum = rank, world_size, accum
        self.epoch = 0
        self.batch = 0  # the next of this rank's batches in the epoch's plan
        self.resumed_at = (0, 0)  # (epoch, global position) the plan of that epoch starts from
        self._cached: dict[int, list[list[int]]] = {}  # two epochs: a prefetching loader runs ahead

    @property
    def batches_per_epoch(self) -> int:
        return len(self.epoch_batches(self.epoch))

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All samples in epoch ``epoch``'s order, the same on every rank."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        rng = np.random.default_rng([self.seed % 2**64, epoch])  # SeedSequence wants seeds >= 0
        return rng.permutation(self.num_samples)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of epoch ``epoch``, in order (of the resumed epoch: from the resume on)."""
        if epoch not in self._cached:
            self._cached = {e: b for e, b in self._cached.items() if e == epoch - 1}
            start = self.resumed_at[1] if epoch == self.resumed_at[0] else 0
            self._cached[epoch] = self._rank_batches(epoch, start)
        return self._cached[epoch]

    def _rank_batches(self, epoch: int, start: int) -> list[list[int]]:
        order = self.epoch_order(epoch)
        b = self.batch_size
        g = b * self.world_size
        steps = (self.num_samples - start) // (g * self.accum)
        first = start + self.rank * b
        return [order[first + k * g : first + k * g + b].tolist() for k in range(steps * self.accum)]

    def plan(self) -> Iterator[tuple[int, int, list[int]]]:
        """Endless ``(epoch, batch, indices)`` from the current position; does not move it."""
        epoch, batch = self.epoch, self.batch
        while True:
            if batch >= len(self.epoch_batches(epoch)):
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

    # what defines the order of an epoch (saved with the position; a resume needs the same), and
    # the settings a person changes to match them
    LAYOUT_KEYS = ("seed", "shuffle", "num_samples")
    LAYOUT_SETTINGS = "the same dataset, train.seed and data.shuffle"
    POSITION = "sample"  # the unit of the global position: samples of the epoch handed out

    def position(self) -> int:
        """The global position in the current epoch: samples handed out by all ranks together."""
        start = self.resumed_at[1] if self.epoch == self.resumed_at[0] else 0
        return start + self.batch * self.batch_size * self.world_size

    def state_dict(self) -> dict:
        """JSON-able; the same on every rank (the rank is not part of it)."""
        return {
            "epoch": self.epoch, self.POSITION: self.position(), "batch_size": self.batch_size,
            "world_size": self.world_size, "accum": self.accum,
            **{key: getattr(self, key) for key in self.LAYOUT_KEYS},
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by :meth:`state_dict`, by any number of ranks; the order must be the same."""
        state = self._upgrade(state)
        mine = self.state_dict()
        wrong = [
            f"{key}: saved {state.get(key)!r}, now {mine[key]!r}"
            for key in self.LAYOUT_KEYS
            if state.get(key) != mine[key]
        ]
        if wrong:
            raise ValueError(
                "cannot resume the data order: the saved sampler state does not match this run ("
                + "; ".join(wrong)
                + f"); {self.LAYOUT_SETTINGS} are needed"
            )
        self.epoch, self.batch = int(state["epoch"]), 0
        self.resumed_at = (self.epoch, self._saved_position(state))
        self._cached = {}

    def _upgrade(self, state: dict) -> dict:
        """A state from before the global position (its batch index on its own ranks) in today's terms."""
        if self.POSITION in state:
            return state
        return {**state, self.POSITION: int(state["batch"]) * int(state["batch_size"]) * int(state["world_size"])}

    def _saved_position(self, state: dict) -> int:
        return int(state[self.POSITION])


class TokenBudgetSampler(FixedSizeSampler):
    """Micro-batches filled up to ``max_tokens`` tokens instead of a fixed number of samples.

    Epoch ``e`` (same permutation as :class:`FixedSizeSampler`) is cut into windows of
    ``window`` samples; inside a window samples go longest first, each into the first
    micro-batch where it still fits (first-fit decreasing), so a batch holds samples of similar
    length and little budget is left unused. A micro-batch's cost is what it computes:
    ``len(batch) * longest`` tokens when padded, the sum of the lengths when packed
    (``packed=True``). A step takes ``M = world_size * accum`` of the epoch's micro-batches,
    dealt to the ranks round-robin; when their number is not a multiple of ``M``, the batches
    with the most samples are split in two (halves stay under the budget) until it is, so every
    rank takes the same number of micro-batches per step and every sample is seen once per
    epoch. Only when no batch has two samples left to split are the last few micro-batches dropped.

    The plan of an epoch is a pure function of the seed, the lengths and the settings (``M``
    among them, not the world size alone), so the global position ``(epoch, micro_batch)``
    resumes it exactly on any ranks with the same ``M``: each step takes the same micro-batches.
    The state carries a checksum of the lengths so a resume on a changed dataset is refused.
    """

    LAYOUT_KEYS = ("seed", "shuffle", "num_samples", "max_tokens", "packed", "window", "lengths_crc", "batches_per_step")
    LAYOUT_SETTINGS = ("the same dataset, train.seed, data.shuffle, data.max_tokens_per_batch, data.packing and "
                       "micro-batches per step (data-parallel ranks x train.grad_accum)")  # fmt: skip
    POSITION = "micro_batch"  # the unit of the global position: micro-batches of the epoch handed out, all ranks

    def __init__(
        self,
        lengths,
        max_tokens: int,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        packed: bool = False,
        window: int = 1024,
        accum: int = 1,
    ):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        too_long = np.flatnonzero(self.lengths > max_tokens)
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(
                f"sample {i} has {int(self.lengths[i])} tokens, more than data.max_tokens_per_batch={max_tokens} "
                f"({too_long.size} such samples)"
            )
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.max_tokens, self.packed, self.window = max_tokens, packed, window
        self.lengths_crc = zlib.crc32(self.lengths.tobytes())  # saved: a resume on changed lengths is refused
        self.batches_per_step = world_size * accum
        super().__init__(len(self.lengths), 1, seed, shuffle, rank, world_size)
        self.accum = accum

    def _rank_batches(self, epoch: int, start: int) -> list[list[int]]:
        order = self.epoch_order(epoch)
        batches = [b for w in range(0, len(order), self.window) for b in self._fill(order[w : w + self.window])]
        batches = self._balance(batches)
        return batches[start + self.rank :: self.world_size]

    def position(self) -> int:
        start = self.resumed_at[1] if self.epoch == self.resumed_at[0] else 0
        return start + self.batch * self.world_size

    def _upgrade(self, state: dict) -> dict:
        if self.POSITION in state:
            return state
        # from before the global position: balanced to its world size, its batch index on its ranks
        world = int(state["world_size"])
        return {**state, "batches_per_step": world, self.POSITION: int(state["batch"]) * world}

    def _fill(self, window: np.ndarray) -> list[list[int]]:
        """Longest first; each sample into the first batch it fits in (first-fit decreasing).

        Padded, a batch costs ``rows * its first (longest) length``: once full it stays full, so
        only the newest batch is open (first fit is next fit). Packed, a batch stays open while
        the shortest sample of the window still fits.
        """
        window = window[np.argsort(-self.lengths[window], kind="stable")]
        shortest = int(self.lengths[window[-1]])
        batches: list[list[int]] = []
        open_: list[tuple[list[int], list[int]]] = []  # (batch, [tokens used]) that may take more
        for i in window.tolist():
            n = int(self.lengths[i])
            for batch, used in open_:
                cost = used[0] + n if self.packed else (len(batch) + 1) * int(self.lengths[batch[0]])
                if cost <= self.max_tokens:
                    batch.append(i)
                    used[0] = cost
                    break
            else:
                batches.append([i])
                if not self.packed:
                    open_.clear()
                open_.append((batches[-1], [n]))
            if self.packed:
                open_ = [(b, u) for b, u in open_ if u[0] + shortest <= self.max_tokens]
        return batches

    def _balance(self, batches: list[list[int]]) -> list[list[int]]:
        """Make the number of batches a multiple of the micro-batches per step (see the class docstring)."""
        m = self.batches_per_step
        while len(batches) % m:
            k = max(range(len(batches)), key=lambda j: len(batches[j]))
            if len(batches[k]) < 2:
                return batches[: len(batches) - len(batches) % m]
            b = batches[k]
            batches[k : k + 1] = [b[: len(b) // 2], b[len(b) // 2 :]]
        return batches
