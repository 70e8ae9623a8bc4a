"""Resumable order: a resumed run's batches equal an uninterrupted run's, on every rank."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from qwenkit import config as qconfig
from qwenkit.data import ResumableSampler, build


def take(iterable, n):
    return list(itertools.islice(iterable, n))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("stop", [0, 3, 4, 9])  # 4 batches per epoch: stop inside, at and past an epoch end
def test_resume_equals_uninterrupted(shuffle, stop):
    reference = take(ResumableSampler(17, 4, seed=3, shuffle=shuffle), 14)
    first = ResumableSampler(17, 4, seed=3, shuffle=shuffle)
    seen = take(first, stop)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = ResumableSampler(17, 4, seed=3, shuffle=shuffle)
    resumed.load_state_dict(state)
    assert seen + take(resumed, 14 - stop) == reference


def test_epochs_reshuffle_and_drop_the_ragged_tail():
    sampler = ResumableSampler(10, 3, seed=0)
    epochs = [take(sampler, 3) for _ in range(3)]
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat)) == 9 and all(len(b) == 3 for b in batches)
    assert epochs[0] != epochs[1] != epochs[2]
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["batch"] == 3
    assert take(ResumableSampler(10, 3, seed=0, shuffle=False), 4) == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [0, 1, 2],
    ]
    assert take(ResumableSampler(10, 3, seed=1), 3) != epochs[0]


def test_ranks_split_the_global_batch():
    """Each rank gets as many batches; together they make the single-process global batch."""
    world, bs, n = 3, 2, 23
    single = take(ResumableSampler(n, bs * world, seed=5), 7)
    ranks = [take(ResumableSampler(n, bs, seed=5, rank=r, world_size=world), 7) for r in range(world)]
    assert all(len(r) == len(ranks[0]) for r in ranks)
    assert len(ResumableSampler(n, bs, seed=5, rank=2, world_size=world)) == n // (bs * world)
    for k in range(7):
        assert [i for r in ranks for i in r[k]] == single[k]
    epoch = [i for r in ranks for b in r[:3] for i in b]
    assert len(epoch) == len(set(epoch)) == 18


def test_state_is_rank_independent_and_checked():
    a = ResumableSampler(20, 2, seed=1, rank=0, world_size=2)
    b = ResumableSampler(20, 2, seed=1, rank=1, world_size=2)
    take(a, 2)
    take(b, 2)
    assert a.state_dict() == b.state_dict()
    other = ResumableSampler(21, 2, seed=1, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"num_samples: saved 20, now 21"):
        other.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match=r"fewer than one global batch"):
        ResumableSampler(3, 2, seed=0, world_size=2)


def batches_equal(x, y):
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("world_size", [1, 2])
def test_bundle_batches_resume(processor, world_size):
    """DataBundle.batches(): state taken between two batches resumes at the next one."""
    cfg = qconfig.load(overrides={"data.tiny_samples": 10, "train.micro_batch_size": 2, "train.seed": 7})
    for rank in range(world_size):
        reference = take(build(cfg, processor, rank, world_size).batches(), 7)
        bundle = build(cfg, processor, rank, world_size)
        it = bundle.batches()
        got = take(it, 4)
        state = json.loads(json.dumps(bundle.sampler.state_dict()))
        resumed = build(cfg, processor, rank, world_size)
        resumed.sampler.load_state_dict(state)
        got += take(resumed.batches(), 3)
        assert all(batches_equal(x, y) for x, y in zip(got, reference, strict=True))


def test_worker_processes_keep_order_and_position(processor):
    """With DataLoader workers prefetching ahead, the order and the saved position stay exact."""
    cfg = qconfig.load(overrides={"data.tiny_samples": 8, "train.micro_batch_size": 2})
    reference = take(build(cfg, processor).batches(), 6)
    cfg.data.num_workers = 2
    bundle = build(cfg, processor)
    it = bundle.batches()
    got = take(it, 3)
    assert bundle.sampler.state_dict()["batch"] == 3 and bundle.sampler.state_dict()["epoch"] == 0
    got += take(it, 3)
    del it
    assert all(batches_equal(x, y) for x, y in zip(got, reference, strict=True))
    assert bundle.sampler.state_dict()["epoch"] == 1 and bundle.sampler.state_dict()["batch"] == 2
