"""Resumable order: a resumed run's batches equal an uninterrupted run's, on every rank."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from qwenkit import config as qconfig
from qwenkit.data import FixedSizeSampler, TokenBudgetSampler, build


def take(iterable, n):
    return list(itertools.islice(iterable, n))


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("stop", [0, 3, 4, 9])  # 4 batches per epoch: stop inside, at and past an epoch end
def test_resume_equals_uninterrupted(shuffle, stop):
    reference = take(FixedSizeSampler(17, 4, seed=3, shuffle=shuffle), 14)
    first = FixedSizeSampler(17, 4, seed=3, shuffle=shuffle)
    seen = take(first, stop)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = FixedSizeSampler(17, 4, seed=3, shuffle=shuffle)
    resumed.load_state_dict(state)
    assert seen + take(resumed, 14 - stop) == reference


def test_epochs_reshuffle_and_drop_the_ragged_tail():
    sampler = FixedSizeSampler(10, 3, seed=0)
    epochs = [take(sampler, 3) for _ in range(3)]
    for batches in epochs:
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat)) == 9 and all(len(b) == 3 for b in batches)
    assert epochs[0] != epochs[1] != epochs[2]
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["sample"] == 9
    assert take(FixedSizeSampler(10, 3, seed=0, shuffle=False), 4) == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [0, 1, 2],
    ]
    assert take(FixedSizeSampler(10, 3, seed=1), 3) != epochs[0]


def test_ranks_split_the_global_batch():
    """Each rank gets as many batches; together they make the single-process global batch."""
    world, bs, n = 3, 2, 23
    single = take(FixedSizeSampler(n, bs * world, seed=5), 7)
    ranks = [take(FixedSizeSampler(n, bs, seed=5, rank=r, world_size=world), 7) for r in range(world)]
    assert all(len(r) == len(ranks[0]) for r in ranks)
    assert len(FixedSizeSampler(n, bs, seed=5, rank=2, world_size=world)) == n // (bs * world)
    for k in range(7):
        assert [i for r in ranks for i in r[k]] == single[k]
    epoch = [i for r in ranks for b in r[:3] for i in b]
    assert len(epoch) == len(set(epoch)) == 18


def test_state_is_rank_independent_and_checked():
    a = FixedSizeSampler(20, 2, seed=1, rank=0, world_size=2)
    b = FixedSizeSampler(20, 2, seed=1, rank=1, world_size=2)
    take(a, 2)
    take(b, 2)
    assert a.state_dict() == b.state_dict()
    other = FixedSizeSampler(21, 2, seed=1, rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"num_samples: saved 20, now 21"):
        other.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match=r"fewer than one global batch"):
        FixedSizeSampler(3, 2, seed=0, world_size=2)


def batches_equal(x, y):
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


LAYOUTS = {
    "padded": {},
    "packed": {"data.packing": True},
    "packed-budget": {"data.packing": True, "data.max_tokens_per_batch": 160, "data.max_length": 160},
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2])
def test_bundle_batches_resume(processor, world_size, layout):
    """DataBundle.batches(): state taken between two batches resumes at the next one."""
    cfg = qconfig.load(
        overrides={"data.tiny_samples": 10, "train.micro_batch_size": 2, "train.seed": 7, **LAYOUTS[layout]}
    )
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
    assert bundle.sampler.state_dict()["sample"] == 6 and bundle.sampler.state_dict()["epoch"] == 0
    got += take(it, 3)
    del it
    assert all(batches_equal(x, y) for x, y in zip(got, reference, strict=True))
    assert bundle.sampler.state_dict()["epoch"] == 1 and bundle.sampler.state_dict()["sample"] == 4


def long_tailed(n, seed=0):
    """Log-normal sample lengths (median ~150), capped at 900."""
    rng = torch.Generator().manual_seed(seed)
    return torch.exp(5.0 + 0.9 * torch.randn(n, generator=rng)).clamp(8, 900).long().tolist()


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_token_budget_never_exceeds_and_covers_every_sample_once(packed, world_size):
    lengths, budget = long_tailed(301), 1000
    ranks = [
        TokenBudgetSampler(lengths, budget, seed=4, rank=r, world_size=world_size, packed=packed, window=64)
        for r in range(world_size)
    ]
    for epoch in range(2):
        per_rank = [r.epoch_batches(epoch) for r in ranks]
        assert len({len(b) for b in per_rank}) == 1  # every rank: the same number of micro-batches
        flat = [i for batches in per_rank for b in batches for i in b]
        assert sorted(flat) == list(range(len(lengths)))  # every sample exactly once per epoch
        for batch in (b for batches in per_rank for b in batches):
            cost = sum(lengths[i] for i in batch) if packed else len(batch) * max(lengths[i] for i in batch)
            assert 0 < cost <= budget
    assert ranks[0].epoch_batches(0) != ranks[0].epoch_batches(1)  # reshuffled
    # the budget is used: far fewer micro-batches than samples
    assert len(ranks[0].epoch_batches(0)) * world_size < len(lengths) / 2


@pytest.mark.parametrize("stop", [0, 5, 23])
def test_token_budget_resume_equals_uninterrupted(stop):
    lengths = long_tailed(97, seed=1)
    make = lambda: TokenBudgetSampler(lengths, 1200, seed=3, rank=1, world_size=2, packed=True, window=32)  # noqa: E731
    reference = take(make(), 40)  # crosses epoch ends (their batch counts differ)
    first = make()
    seen = take(first, stop)
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert seen + take(resumed, 40 - stop) == reference


def test_token_budget_checks_samples_and_resume_layout():
    with pytest.raises(ValueError, match=r"sample 2 has 700 tokens, more than data.max_tokens_per_batch=600"):
        TokenBudgetSampler([10, 20, 700], 600, seed=0)
    saved = TokenBudgetSampler([10, 20, 30, 40], 600, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"lengths_crc"):
        TokenBudgetSampler([10, 20, 30, 41], 600, seed=0).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"max_tokens: saved 600, now 500"):
        TokenBudgetSampler([10, 20, 30, 40], 500, seed=0).load_state_dict(saved)
    # splitting keeps the ranks even: 3 samples that fit one batch become 2 batches on 2 ranks
    two = [TokenBudgetSampler([10, 20, 30], 600, seed=0, rank=r, world_size=2, packed=True) for r in (0, 1)]
    assert sorted(i for s in two for b in s.epoch_batches(0) for i in b) == [0, 1, 2]
    assert [len(s.epoch_batches(0)) for s in two] == [1, 1]


def test_a_token_budget_with_fewer_samples_than_a_steps_micro_batches_is_refused_at_once():
    """Each micro-batch holds one sample at least: 3 samples cannot fill the 4 micro-batches of a step
    on 2 ranks x 2 accumulation steps (the epoch would hold no step), said when the sampler is made, as
    a fixed size's; 4 samples can, each its own micro-batch."""
    with pytest.raises(ValueError, match=r"^the dataset has 3 usable samples, fewer than one step's micro-batches "
                                         r"\(data.max_tokens_per_batch: one sample at least each\): 2 data-parallel "
                                         r"rank\(s\) x train.grad_accum=2 = 4; "):  # fmt: skip
        TokenBudgetSampler([10, 20, 30], 600, seed=0, world_size=2, accum=2, packed=True)
    four = [TokenBudgetSampler([10, 20, 30, 40], 600, seed=0, rank=r, world_size=2, accum=2, packed=True) for r in (0, 1)]
    assert sorted(i for s in four for b in s.epoch_batches(0) for i in b) == [0, 1, 2, 3]
    assert [len(s.epoch_batches(0)) for s in four] == [2, 2]


def test_token_budget_config_is_checked():
    with pytest.raises(qconfig.ConfigError, match=r"data.max_tokens_per_batch=512 is below data.max_length=1024"):
        qconfig.load(overrides={"data.max_tokens_per_batch": 512})
    with pytest.raises(qconfig.ConfigError, match=r"'sample_mean' is not available with data.packing=true"):
        qconfig.load(overrides={"data.packing": True, "loss.loss_type": "sample_mean"})


def _steps(samplers, steps):
    """Per step, the samples all ranks took (``accum`` micro-batches each), as sorted lists."""
    its = [iter(s) for s in samplers]
    accum = samplers[0].accum
    return [sorted(i for it in its for _ in range(accum) for i in next(it)) for _ in range(steps)]


def _fixed(world, bs, accum, n=18):
    return [FixedSizeSampler(n, bs, seed=2, rank=r, world_size=world, accum=accum) for r in range(world)]


def _resumed(make, state):
    samplers = make()
    for s in samplers:
        s.load_state_dict(json.loads(json.dumps(state)))
    return samplers


@pytest.mark.parametrize("saved, now", [((2, 2, 1), (1, 2, 2)), ((1, 2, 2), (2, 2, 1)), ((2, 2, 1), (4, 1, 1)),
                                        ((2, 2, 1), (1, 4, 1))])  # fmt: skip
@pytest.mark.parametrize("stop", [1, 3, 4, 6])  # 4 steps of 4 samples per epoch: inside, at and past an epoch end
def test_resume_on_other_ranks_keeping_the_global_batch_takes_the_same_steps(saved, now, stop):
    reference = _steps(_fixed(*saved), 10)
    first = _fixed(*saved)
    _steps(first, stop)
    assert len({json.dumps(s.state_dict()) for s in first}) == 1  # the position is global
    resumed = _resumed(lambda: _fixed(*now), first[0].state_dict())
    assert _steps(resumed, 10 - stop) == reference[stop:]


@pytest.mark.parametrize("saved, now", [((2, 2, 1), (4, 2, 1)), ((4, 2, 1), (1, 1, 3)), ((1, 2, 1), (2, 3, 1))])
def test_resume_with_another_global_batch_sees_each_sample_once_per_epoch(saved, now):
    n = 23
    first = _fixed(*saved, n=n)
    done = _steps(first, 1)
    rest = _resumed(lambda: _fixed(*now, n=n), first[0].state_dict())
    per_step = now[0] * now[1] * now[2]
    epoch = [i for step in done + _steps(rest, (n - len(done[0])) // per_step) for i in step]
    assert len(epoch) == len(set(epoch)) and len(epoch) > n - per_step  # none twice, only a ragged tail left
    assert rest[0].state_dict()["epoch"] == 0 and next(iter(rest[0])) and rest[0].state_dict()["epoch"] == 1


def _budget(world, accum, lengths):
    return [TokenBudgetSampler(lengths, 1000, seed=4, rank=r, world_size=world, packed=True, window=64, accum=accum)
            for r in range(world)]  # fmt: skip


@pytest.mark.parametrize("saved, now", [((2, 1), (1, 2)), ((1, 4), (4, 1)), ((2, 2), (4, 1))])
def test_token_budget_resume_on_other_ranks_with_the_same_batches_per_step(saved, now):
    lengths = long_tailed(211, seed=3)
    reference = _steps(_budget(*saved, lengths), 30)  # crosses an epoch end
    first = _budget(*saved, lengths)
    _steps(first, 7)
    resumed = _resumed(lambda: _budget(*now, lengths), first[0].state_dict())
    assert _steps(resumed, 23) == reference[7:]
    with pytest.raises(ValueError, match=r"batches_per_step: saved 4, now 2"):
        _budget(2, 1, lengths)[0].load_state_dict(_budget(2, 2, lengths)[0].state_dict())


def test_a_state_from_before_the_global_position_resumes():
    """Checkpoints written before ``sample`` / ``micro_batch`` held the rank's batch index."""
    fixed = FixedSizeSampler(17, 2, seed=3, rank=1, world_size=2)
    reference = take(fixed, 9)
    old = {"epoch": 1, "batch": 1, "seed": 3, "shuffle": True, "num_samples": 17, "batch_size": 2, "world_size": 2}
    resumed = FixedSizeSampler(17, 2, seed=3, rank=1, world_size=2)
    resumed.load_state_dict(old)
    assert take(resumed, 4) == reference[5:]
    lengths = long_tailed(97, seed=1)
    budget = TokenBudgetSampler(lengths, 1200, seed=3, rank=1, world_size=2, packed=True, window=32)
    reference = take(budget, 12)
    old = {"epoch": 0, "batch": 5, "seed": 3, "shuffle": True, "num_samples": 97, "max_tokens": 1200, "packed": True,
           "window": 32, "lengths_crc": budget.lengths_crc, "world_size": 2}  # fmt: skip
    resumed = TokenBudgetSampler(lengths, 1200, seed=3, rank=1, world_size=2, packed=True, window=32)
    resumed.load_state_dict(old)
    assert take(resumed, 7) == reference[5:]


def first_fit_decreasing(lengths, order, budget, window, packed):
    """The plain reference: per window longest first, each sample into the first open batch it fits."""
    batches = []
    for w in range(0, len(order), window):
        part = sorted(order[w : w + window], key=lambda i: -lengths[i])  # sorted() is stable: ties keep order
        shortest, open_ = lengths[part[-1]], []
        for i in part:
            costs = ((sum(lengths[j] for j in b) + lengths[i] if packed else (len(b) + 1) * lengths[b[0]], b) for b in open_)
            fit = next((b for cost, b in costs if cost <= budget), None)
            if fit is None:
                batches.append(fit := [])
                open_ = open_ if packed else []
                open_.append(fit)
            fit.append(i)
            if packed:
                open_ = [b for b in open_ if sum(lengths[j] for j in b) + shortest <= budget]
    return batches


@pytest.mark.parametrize("packed", [True, False])
def test_token_budget_batches_equal_a_plain_first_fit_decreasing(packed):
    """The vectorised plan (arrays, no Python list per batch) equals the per-sample loop it replaced."""
    lengths = long_tailed(500, seed=7)
    for window, budget in ((1, 1000), (37, 1000), (128, 2500)):
        sampler = TokenBudgetSampler(lengths, budget, seed=5, packed=packed, window=window)
        order = sampler.epoch_order(1).tolist()
        assert list(sampler.epoch_batches(1)) == first_fit_decreasing(lengths, order, budget, window, packed)
