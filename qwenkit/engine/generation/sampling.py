"""How replies are sampled (:class:`Sampling`), and sampling in which every row of a batch draws from its own seeded generator.

HF ``generate`` samples a batch with one ``torch.multinomial`` call on the global RNG: a row's
tokens then depend on which rows share its batch and in which order. GRPO's rollouts must not
(2 ranks sample what 1 process samples, a resumed run what the uninterrupted one did, whatever
``grpo.rollout_batch_size`` is), so :class:`RowSampler` does the drawing itself, as the last
logits processor of a *greedy* ``generate``:

1. HF's own processors run first (suppressed tokens, ``min_new_tokens``), as when HF samples;
2. HF's own warpers, in HF's order: temperature, top-k, top-p;
3. each row ``b`` draws ``u_b`` from its generator (one number a step) and takes the token where
   the cumulative probability first exceeds ``u_b``: inverse-CDF sampling, exactly the
   categorical distribution of step 2, vectorised over the batch;
4. the row's scores become ``0`` at that token and ``-inf`` elsewhere, so greedy decoding picks it;
5. with ``record``, the log-prob of the token drawn under the distribution of step 2 is kept, a
   ``[B]`` tensor a step in ``RowSampler.logps``: what GRPO's importance-sampling correction
   divides by when the rollout's distribution is not the trainer's (``grpo.rollout_dtype``).

A row's draws are its generator's numbers in order, one per step while it runs: they depend on its
seed and its own tokens alone. Its probabilities are computed in a batch, so a float rounding that
differs with the batch shape could move a boundary past ``u_b``; the change is of the order of one
ulp of a probability, and tests find batched and row-at-a-time samples equal (fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass(frozen=True)
class Sampling:
    """How replies are generated: ``train.eval_max_new_tokens``, ``eval_batch_size``,
    ``eval_temperature`` (0: greedy), ``eval_top_p``; ``seed`` seeds sampling (with the rank)."""

    max_new_tokens: int
    batch_size: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def of(cls, train_cfg, **changes) -> Sampling:
        t = train_cfg
        settings = dict(max_new_tokens=t.eval_max_new_tokens, batch_size=t.eval_batch_size,
                        temperature=t.eval_temperature, top_p=t.eval_top_p, seed=t.seed)  # fmt: skip
        return cls(**{**settings, **changes})


class RowSampler(LogitsProcessor):
    """Draw row ``b``'s next token from ``seeds[b]``'s generator (module docstring); pass it to a greedy ``generate``."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float = 1.0, top_k: int = 0, record: bool = False):
        if temperature <= 0:
            raise ValueError(f"sampling needs temperature > 0, got {temperature}")
        self.seeds = list(seeds)
        self.logps: list[torch.Tensor] | None = [] if record else None  # per step: [B] the drawn tokens' log-probs
        self.generators: list[torch.Generator] | None = None  # made on the first call, on the scores' device
        warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
        warpers += [TopKLogitsWarper(top_k)] if top_k > 0 else []
        warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
        self.warpers = LogitsProcessorList(warpers)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.shape[0] != len(self.seeds):
            raise ValueError(f"a batch of {scores.shape[0]} rows for {len(self.seeds)} seeds")
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        warped = self.warpers(input_ids, scores).float()  # [B, V] the scores each row draws from (steps 1-2)
        cdf = torch.softmax(warped, dim=-1).cumsum(dim=-1)  # [B, V]
        u = torch.cat([torch.rand(1, generator=g, device=scores.device) for g in self.generators])  # [B]
        # the first token whose cumulative mass exceeds u * total: never one of zero probability
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=cdf.shape[1] - 1)  # [B, 1]
        if self.logps is not None:
            self.logps.append(torch.log_softmax(warped, dim=-1).gather(1, tokens).squeeze(1))
        out = torch.full_like(scores, -torch.inf)
        return out.scatter_(1, tokens, 0.0)


__all__ = ["RowSampler", "Sampling"]
