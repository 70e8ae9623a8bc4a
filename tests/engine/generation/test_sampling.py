"""RowSampler: each row draws from its own seeded generator, whatever shares its batch, from the
tempered top-p distribution (checked by hand: frequencies of many draws, never a token outside the nucleus)."""

from __future__ import annotations

import torch

from qwenkit.engine.generation.sampling import RowSampler


def _draws(sampler: RowSampler, scores: torch.Tensor, steps: int) -> list[list[int]]:
    """Each row's tokens over ``steps`` calls on the same scores (a generate loop's draws)."""
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    out = []
    for _ in range(steps):
        chosen = sampler(ids, scores.clone())
        assert ((chosen == 0).sum(-1) == 1).all() and torch.isinf(chosen).sum(-1).eq(scores.shape[1] - 1).all()
        out.append(chosen.argmax(-1).tolist())
    return [list(row) for row in zip(*out)]


def test_a_rows_draws_depend_on_its_seed_alone_not_on_its_batch():
    scores = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    together = _draws(RowSampler([11, 12, 13], temperature=0.8, top_p=0.95), scores, steps=6)
    alone = _draws(RowSampler([12], temperature=0.8, top_p=0.95), scores[1:2], steps=6)
    reordered = _draws(RowSampler([13, 12], temperature=0.8, top_p=0.95), scores[[2, 1]], steps=6)
    assert together[1] == alone[0] == reordered[1] and together[2] == reordered[0]
    assert together[0] != together[1]  # other seeds, other draws


def test_draws_follow_the_tempered_nucleus_by_hand():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    probs = torch.softmax(logits / 0.7, dim=0)  # descending already
    keep = int((probs.cumsum(0) < 0.9).sum()) + 1  # the fewest top tokens holding 0.9 of the mass
    want = torch.zeros_like(probs)
    want[:keep] = probs[:keep] / probs[:keep].sum()
    n = 4000
    sampler = RowSampler(list(range(n)), temperature=0.7, top_p=0.9)
    got = sampler(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, -1).clone()).argmax(-1)
    freq = torch.bincount(got, minlength=6).float() / n
    assert (freq[keep:] == 0).all()  # never a token outside the nucleus
    sigma = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 4 * sigma + 1e-9).all(), (freq, want)  # 4 sigma: fails by chance ~1e-4


def test_a_batch_needs_one_seed_a_row():
    sampler = RowSampler([1, 2], temperature=1.0)
    try:
        sampler(torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 5))
    except ValueError as e:
        assert "3 rows for 2 seeds" in str(e)
    else:
        raise AssertionError("a batch of 3 rows with 2 seeds was sampled")
