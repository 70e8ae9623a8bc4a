"""DAPO's dynamic sampling (``grpo.dynamic_sampling``): a rollout's groups whose rewards are all equal
teach nothing (their advantages are 0), so they are dropped and more prompts are drawn until the batch
is full again.

A group is informative when its rewards are not all equal (``frac_reward_zero_std``'s test, TRL's:
the std is close to 0). Each round draws as many prompts as one rollout (:func:`fill`'s ``draw``: the
sampler's next batches, so a resumed run draws what the uninterrupted one did) and every rank keeps its
informative groups in draw order until it holds the batch's number, at most ``grpo.max_resample_rounds``
rounds after the first. Every rank rolls out the same number of rounds (the stop is agreed by an
all-reduce: a rollout gathers the policy's weights, a collective). A rank still short after the last
round fills its batch with the dropped groups it drew first (their advantages stay 0: no gradient but the
KL's), so the batch keeps its shape; ``frac_reward_zero_std`` then says how many.

Peers: DAPO (arXiv 2503.14476, "dynamic sampling"), verl's ``algorithm.filter_groups``
(``max_num_gen_batches``), ms-swift's ``dynamic_sample`` (``max_resample_times``). Logged:
``dynamic_sampling/frac_reward_zero_std_drawn`` (the first round's share of uninformative groups: the
batch without dynamic sampling), ``dynamic_sampling/rounds`` and ``dynamic_sampling/extra_prompts``
(prompts drawn beyond the batch, every rank's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qwenkit.engine.rollouts.completion import Completion


@dataclass
class Round:
    """One rollout's completions (groups of ``num_generations`` in a row), their rewards and draws."""

    done: list[Completion]
    per: torch.Tensor  # [n, rewards] each reward's score
    total: torch.Tensor  # [n] the weighted reward
    epochs: list[int]  # [n] the sampler's epoch each completion was drawn in (its seed's draw)

    def group(self, j: int, size: int) -> Round:
        part = slice(j * size, (j + 1) * size)
        return Round(self.done[part], self.per[part], self.total[part], self.epochs[part])


def informative(total: torch.Tensor, size: int) -> torch.Tensor:
    """``[groups]`` bool: the group's rewards are not all equal (``total [groups x size]``)."""
    std = total.view(-1, size).std(dim=1)
    return ~torch.isclose(std, torch.zeros_like(std))


def fill(draw: Callable[[], Round], size: int, max_rounds: int, device) -> tuple[Round, dict[str, float]]:
    """The batch of one rollout's number of groups from ``draw``'s rounds (module docstring) and its metrics."""
    first = draw()
    quota = len(first.done) // size
    kept: list[Round] = []
    dropped: list[Round] = []
    current, rounds = first, 1
    while True:
        for j, useful in enumerate(informative(current.total, size).tolist()):
            (kept if useful else dropped).append(current.group(j, size))
        short = torch.tensor([max(0, quota - len(kept))], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(short, op=dist.ReduceOp.MAX)  # every rank draws again while any rank is short
        if not short.item() or rounds > max_rounds:
            break
        current, rounds = draw(), rounds + 1
    groups = (kept + dropped)[:quota]  # the informative first, in draw order
    drawn = torch.tensor([float(quota - int(informative(first.total, size).sum())), float(quota)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(drawn)  # [uninformative groups of the first round, its groups], every rank's
    batch = Round([c for g in groups for c in g.done], torch.cat([g.per for g in groups]),
                  torch.cat([g.total for g in groups]), [e for g in groups for e in g.epochs])  # fmt: skip
    metrics = {"dynamic_sampling/frac_reward_zero_std_drawn": (drawn[0] / drawn[1]).item(),
               "dynamic_sampling/rounds": float(rounds),
               "dynamic_sampling/extra_prompts": (rounds - 1) * drawn[1].item()}  # fmt: skip
    return batch, metrics


__all__ = ["Round", "fill", "informative"]
