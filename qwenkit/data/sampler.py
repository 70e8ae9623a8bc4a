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
from collections.abc import Iterator, Sequence

import numpy as np


def too_small(num_samples: int, batch_size: int | None, world_size: int, accum: int, unit: str = "samples",
              what: str | None = None) -> str | None:  # fmt: skip
    """Why ``num_samples`` cannot fill one optimizer step, or None: the one rule of a dataset too small to
    train, asked by the samplers and, before any rank starts, by the launcher
    (:func:`qwenkit.data.pipeline.step_problem`).

    A step takes ``batch_size x world_size x accum`` samples (``world_size``: the data-parallel ranks);
    ``batch_size`` None: micro-batches filled to a token budget (:class:`TokenBudgetSampler`), each of one
    sample at least, ``world_size x accum`` of them a step (fewer samples leave an epoch without a step).
    ``what`` names the count (default: ``the dataset has N usable <unit>``).
    """
    need = (batch_size or 1) * world_size * accum
    if num_samples >= need:
        return None
    what = what or f"the dataset has {num_samples} usable {unit}"
    if batch_size is None:
        return (f"{what}, fewer than one step's micro-batches (data.max_tokens_per_batch: one {unit[:-1]} at least "
                f"each): {world_size} data-parallel rank(s) x train.grad_accum={accum} = {need}; add rows, or lower --nproc or "
                "train.grad_accum")  # fmt: skip
    return (f"{what}, fewer than one global batch: train.micro_batch_size={batch_size} x {world_size} data-parallel rank(s) x "
            f"train.grad_accum={accum} = {need}; add rows, or lower train.micro_batch_size, --nproc or train.grad_accum")  # fmt: skip


class EpochBatches(Sequence):
    """One rank's micro-batches of an epoch, held as the epoch's order and where each batch lies in it.

    With a fixed ``size``, micro-batch ``k`` is ``order[j : j + size]``, ``j = first + k * stride``
    in samples. With ``starts`` (the epoch's global micro-batches' starts in ``order``, and its
    end), it is global micro-batch ``j = first + k * stride``: ``order[starts[j] : starts[j + 1]]``.
    Nothing is built per batch until it is asked for (at 1M rows a list of lists per epoch took
    ~74 MiB and ~10 s per rank).
    """

    def __init__(self, order: np.ndarray, first: int, stride: int, count: int, size: int = 0,
                 starts: np.ndarray | None = None):  # fmt: skip
        self.order, self.first, self.stride, self.count = order, first, stride, count
        self.size, self.starts = size, starts  # either a fixed size or the global batches' starts (+ the end)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, k: int) -> list[int]:
        if not -self.count <= k < self.count:
            raise IndexError(f"micro-batch {k} of {self.count}")
        j = self.first + (k % self.count) * self.stride
        if self.starts is None:
            return self.order[j : j + self.size].tolist()
        return self.order[self.starts[j] : self.starts[j + 1]].tolist()

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))


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
        unit: str = "samples",  # what an index is, for the messages (a preference pair: "pairs")
        budget: bool = False,  # micro-batches filled to a token budget (TokenBudgetSampler): batch_size is 1
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if problem := too_small(num_samples, None if budget else batch_size, world_size, accum, unit):
            raise ValueError(problem)
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.rank, self.world_size, self.accum = rank, world_size, accum
        self.epoch = 0
        self.batch = 0  # the next of this rank's batches in the epoch's plan
        self.resumed_at = (0, 0)  # (epoch, global position) the plan of that epoch starts from
        self._cached: dict[int, EpochBatches] = {}  # two epochs: a prefetching loader runs ahead

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

    def epoch_batches(self, epoch: int) -> EpochBatches:
        """This rank's batches of epoch ``epoch``, in order (of the resumed epoch: from the resume on)."""
        if epoch not in self._cached:
            self._cached = {e: b for e, b in self._cached.items() if e == epoch - 1}
            start = self.resumed_at[1] if epoch == self.resumed_at[0] else 0
            self._cached[epoch] = self._rank_batches(epoch, start)
        return self._cached[epoch]

    def _rank_batches(self, epoch: int, start: int) -> EpochBatches:
        b = self.batch_size
        g = b * self.world_size
        steps = (self.num_samples - start) // (g * self.accum)
        # the rank's k-th batch starts at sample start + rank * b + k * g of the epoch's order
        return EpochBatches(self.epoch_order(epoch), start + self.rank * b, g, steps * self.accum, size=b)

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
        super().__init__(len(self.lengths), 1, seed, shuffle, rank, world_size, accum, budget=True)

    def _rank_batches(self, epoch: int, start: int) -> EpochBatches:
        order, sizes = self._balance(*self._fill(self.epoch_order(epoch)))
        starts = np.concatenate(([0], np.cumsum(sizes)))  # [batches + 1]
        count = len(range(start + self.rank, len(sizes), self.world_size))
        return EpochBatches(order, start + self.rank, self.world_size, count, starts=starts)

    def position(self) -> int:
        start = self.resumed_at[1] if self.epoch == self.resumed_at[0] else 0
        return start + self.batch * self.world_size

    def _upgrade(self, state: dict) -> dict:
        if self.POSITION in state:
            return state
        # from before the global position: balanced to its world size, its batch index on its ranks
        world = int(state["world_size"])
        return {**state, "batches_per_step": world, self.POSITION: int(state["batch"]) * world}

    def _fill(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's micro-batches: ``(order, sizes)``, batch ``k`` the next ``sizes[k]`` samples of ``order``.

        Each window goes longest first (ties in epoch order), each sample into the first batch of
        its window it fits in (first-fit decreasing); a batch holds its samples in that order.
        """
        lengths = self.lengths[order]
        by = np.lexsort((-lengths, np.arange(len(order)) // self.window))  # stable: ties keep epoch order
        order, lengths = order[by], lengths[by]
        if not self.packed:
            return order, self._fill_padded(lengths)
        batch = self._fill_packed(lengths)  # [samples] the batch each sorted sample went to
        return order[np.argsort(batch, kind="stable")], np.bincount(batch)

    def _fill_padded(self, lengths: np.ndarray) -> np.ndarray:
        """Padded, a batch costs ``rows * its first (longest) length``: once full it stays full, so only
        the newest batch is open (first fit is next fit), and it takes ``max_tokens // that length`` rows."""
        rows = self.max_tokens // lengths
        sizes, p = [], 0  # one loop turn per batch, not per sample
        while p < len(lengths):
            end = min(p + int(rows[p]), (p // self.window + 1) * self.window, len(lengths))
            sizes.append(end - p)
            p = end
        return np.asarray(sizes, dtype=np.int64)

    def _fill_packed(self, lengths: np.ndarray) -> np.ndarray:
        """Packed, a batch costs the sum of its lengths and stays open while the shortest sample of
        its window still fits; returns the batch of each sample, batches numbered as they open."""
        batch = np.empty(len(lengths), dtype=np.int64)
        opened = 0
        for w in range(0, len(lengths), self.window):
            window = lengths[w : w + self.window].tolist()  # one window's Python ints at a time
            shortest, ids = window[-1], []
            open_: list[list[int]] = []  # [batch, tokens used] of the batches that may take more
            for n in window:
                for entry in open_:
                    if entry[1] + n <= self.max_tokens:
                        entry[1] += n
                        ids.append(entry[0])
                        break
                else:
                    open_.append([opened, n])
                    ids.append(opened)
                    opened += 1
                open_ = [e for e in open_ if e[1] + shortest <= self.max_tokens]
            batch[w : w + len(window)] = ids
        return batch

    def _balance(self, order: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Make the number of batches a multiple of the micro-batches per step (see the class docstring)."""
        m = self.batches_per_step
        while len(sizes) % m:
            k = int(np.argmax(sizes))  # the first of the largest
            if sizes[k] < 2:
                keep = len(sizes) - len(sizes) % m
                return order[: int(sizes[:keep].sum())], sizes[:keep]
            sizes = np.insert(sizes, k + 1, sizes[k] - sizes[k] // 2)
            sizes[k] //= 2
        return order, sizes
