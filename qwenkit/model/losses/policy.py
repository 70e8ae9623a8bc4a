"""GRPO's loss (and Dr. GRPO, DAPO, BNPO, GSPO, CISPO, SAPO, GMPO) of per-token log-probs: the math, no model.

Inputs per completion ``b`` and completion token ``t`` (``mask [B, T]`` marks them): the policy's
log-probs ``logp`` (:func:`qwenkit.model.losses.logps.token_logps`), the rollout policy's ``old``
(``None``: this is the rollout's own policy, ``old = logp.detach()``), the reference's ``ref``
(``beta > 0``) and the advantage ``A[b]`` (:func:`group_advantages`). As TRL 1.16's
``GRPOTrainer._compute_loss``:

1. ``r = exp(logp - old)``; GSPO (``importance_sampling_level: sequence``): one ratio per
   completion, ``exp(mean_t(logp - old))``
2. the entry's per-token loss ``l``: PPO's clipped ``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)``
   (grpo, dr_grpo, dapo, bnpo), or CISPO's, SAPO's, GMPO's (:func:`cispo_surrogate`,
   :func:`sapo_surrogate`, :func:`gmpo_surrogate`)
3. with ``top_entropy_quantile < 1``: ``l`` kept on the high-entropy tokens only (:func:`high_entropy_mask`)
4. ``+ beta * (exp(ref - logp) - (ref - logp) - 1)`` (k3, Schulman's unbiased KL estimator)
5. the reduction of ``grpo.loss_type``'s entry (:mod:`qwenkit.model.losses.registry`), a **share** of the
   whole optimizer step (all ranks, all micro-batches), as the SFT loss is a share of the global token
   mean, so world size and accumulation change nothing.

Steps 1-2 are the entry's surrogate, step 5 its reduction (:data:`REDUCE`): each loss is an entry of the
registry, never a branch here. Every surrogate takes ``(log_ratio, advantages, settings, logps, mask)``
and reads what it needs (CISPO the log-probs themselves, GMPO the mask of its token mean).

With vLLM rollouts (``grpo.rollout_engine: vllm``), step 2's per-token loss is weighed by the
truncated importance-sampling ratio of the trainer's and vLLM's log-probs of the sampled tokens
(:func:`vllm_importance_weights`, TRL's ``vllm_importance_sampling_correction``), before the KL term.

``mask_truncated_completions`` removes a completion cut at ``max_new_tokens`` from ``mask``
(TRL's ``completion_mask``): it still counts as a completion (grpo, dr_grpo), not as tokens.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qwenkit.config import GrpoConfig
from qwenkit.model.losses.registry import policy_loss

STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages [N], std_zero [N] bool)`` of the weighted rewards ``[N]`` of consecutive groups.

    ``advantage = reward - its group's mean``, divided by ``std + 1e-4`` where ``std`` is the
    group's (``group``) or the whole batch's (``batch``) unbiased std; ``none`` does not divide
    (Dr. GRPO). ``std_zero``: the group's rewards are all equal (``frac_reward_zero_std``).
    """
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of grpo.num_generations={num_generations}")
    grouped = rewards.view(-1, num_generations)  # [groups, G]
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = rewards.std().expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif scale_rewards in ("group", "none"):
        std = grouped.std(dim=1).repeat_interleave(num_generations)
    else:
        raise ValueError(f"grpo.scale_rewards must be group, batch or none, got {scale_rewards!r}")
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    return advantages, torch.isclose(std, torch.zeros_like(std))


def vllm_importance_weights(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str,
                            clip_min: float | None, clip_max: float | None) -> torch.Tensor:  # fmt: skip
    """TRL 1.16's vLLM importance-sampling ratios: ``[B, T]`` (``token_*``) or ``[B, 1]`` (``sequence_*``).

    ``old``: the trainer's log-probs of the sampled tokens at the rollout, ``sampling``: vLLM's, both
    ``[B, T]`` on the completion positions of ``mask``. ``r = exp(old - sampling)`` per token, or of the
    sum over the completion (``sequence_*``); ``*_truncate`` clamps ``r`` into ``[clip_min, clip_max]``,
    ``*_mask`` sets ratios outside them to 0 (the token, or the sequence, adds no loss).
    """
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)  # a token vLLM could not score: no correction
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)  # [B, 1]
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if not mode.endswith("mask"):
        raise ValueError(f"grpo.vllm_importance_sampling_mode must be one of token_truncate, token_mask, "
                         f"sequence_truncate, sequence_mask; got {mode!r}")  # fmt: skip
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@dataclass
class StepTotals:
    """The optimizer step's counts over every rank and micro-batch: the reductions' denominators."""

    completions: int | torch.Tensor
    tokens: int | torch.Tensor  # completion tokens left in the masks
    micro_batches: int | torch.Tensor  # over all ranks (bnpo averages their token means)


@dataclass
class GrpoTerms:
    loss: torch.Tensor  # this micro-batch's share of the step's loss
    kl: torch.Tensor | None  # [B, T] per-token k3 KL, detached (beta > 0)
    ratio: torch.Tensor  # [B, T] or [B, 1] (sequence level), detached
    low_clipped: torch.Tensor  # same shape, bool: the ratio fell under 1 - eps with A < 0
    high_clipped: torch.Tensor  # the ratio rose over 1 + eps_high with A > 0
    mask: torch.Tensor  # [B, T] the mask used (truncated completions removed when asked)


@dataclass
class Surrogate:
    """What an entry's surrogate returns: steps 1-2 of the module docstring."""

    per_token: torch.Tensor  # [B, T] or [B, 1] (one loss per completion) before weighting, KL and mask
    ratio: torch.Tensor  # [B, T] or [B, 1] (sequence level), detached: the ratio the clip metrics count over
    low_clipped: torch.Tensor  # bool, ratio's shape: the clip bound the ratio from below with A < 0
    high_clipped: torch.Tensor  # bool: ... from above with A > 0


def clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, loss: GrpoLoss, logps: torch.Tensor,
                      mask: torch.Tensor) -> Surrogate:  # fmt: skip
    """PPO's clipped surrogate (steps 1-2): ``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)``, ``r = exp(log_ratio)``."""
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - loss.eps_low, 1 + loss.eps_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)  # [B, T] or [B, 1]
    with torch.no_grad():
        low = (ratio < 1 - loss.eps_low) & (advantages < 0)
        high = (ratio > 1 + loss.eps_high) & (advantages > 0)
    return Surrogate(per_token, ratio.detach(), low, high)


def cispo_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, loss: GrpoLoss, logps: torch.Tensor,
                    mask: torch.Tensor) -> Surrogate:  # fmt: skip
    """CISPO (MiniMax-M1; TRL's ``cispo``): ``-sg(min(r, eps_high)) A logp``.

    The importance weight is clipped and its gradient stopped, and every token keeps the REINFORCE
    gradient ``-w A grad logp`` (PPO's clip drops the clipped tokens' gradient altogether).
    ``eps_high`` is the weight's upper bound itself (TRL's and ScaleRL's ``epsilon_max``, 5.0), not
    ``1 + eps_high``; there is no lower bound. ``high_clipped``: TRL's ``cispo_clip_ratio``."""
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=loss.eps_high).detach()  # [B, T] or [B, 1]
    per_token = -weight * advantages * logps  # [B, T]: a sequence-level weight scales each token's log-prob
    with torch.no_grad():
        high = (ratio > loss.eps_high) & (advantages > 0)
    return Surrogate(per_token, ratio.detach(), torch.zeros_like(high), high)


def sapo_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, loss: GrpoLoss, logps: torch.Tensor,
                   mask: torch.Tensor) -> Surrogate:  # fmt: skip
    """SAPO (Qwen's Soft Adaptive Policy Optimization; TRL's ``sapo``): ``-sigmoid(tau (r - 1)) 4 / tau A``.

    A smooth gate instead of the hard clip: its slope is ``4 s (1 - s)`` (1 at ``r = 1``, fading as
    ``r`` leaves 1), ``tau`` is ``sapo_temperature_pos`` where ``A > 0``, else ``sapo_temperature_neg``
    (a larger ``tau`` fades faster). Nothing is bound, so nothing counts as clipped."""
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, loss.sapo_temperature_pos, loss.sapo_temperature_neg)  # [B, 1]
    per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return Surrogate(per_token, ratio.detach(), none, none)


def gmpo_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, loss: GrpoLoss, logps: torch.Tensor,
                   mask: torch.Tensor) -> Surrogate:  # fmt: skip
    """GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673): ``-A (prod_t min(r_t^s, clip(r_t)^s))^(s / |o|)``.

    ``s = sign(A)``, ``clip`` into ``[exp(-eps), exp(eps_high)]``: the geometric mean of the completion's
    token ratios, each clipped on the pessimistic side, in log space (the paper's code): ``m_t = s
    min(s l_t, s clamp(l_t, -eps, eps_high))``, ``l = -A exp(mean_t m_t)``, one loss per completion
    ``[B, 1]`` (the ``sequence_mean`` reduction: the paper's mean over completions). ``eps``,
    ``eps_high`` are log-ratio bounds here (the paper's 0.4 each). The clip metrics count tokens."""
    sign = torch.sign(advantages)  # [B, 1]
    clamped = torch.clamp(log_ratio, -loss.eps_low, loss.eps_high)
    kept = sign * torch.min(sign * log_ratio, sign * clamped)  # [B, T]
    mean = (kept * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)  # [B, 1]
    per_sequence = -advantages * torch.exp(mean)
    with torch.no_grad():
        low = (log_ratio < -loss.eps_low) & (advantages < 0)
        high = (log_ratio > loss.eps_high) & (advantages > 0)
    return Surrogate(per_sequence, torch.exp(log_ratio).detach(), low, high)


def _quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(values, q)`` (linear interpolation, the same arithmetic) without its limit of
    2**24 elements, which a micro-batch's tokens over every rank pass at length (64 ranks x 8 x 32k)."""
    ordered = values.sort().values
    rank = torch.tensor(q, dtype=values.dtype, device=values.device) * (values.numel() - 1)
    below, above = rank.long(), rank.ceil().long()
    return torch.lerp(ordered[below], ordered[above], rank - below)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float, counted: bool = True) -> torch.Tensor:
    """``[B, T]`` bool: the tokens of ``mask`` whose entropy is in the top ``quantile`` (TRL 1.16's
    ``get_high_entropy_mask`` with threshold ``1 - top_entropy_quantile``; "Beyond the 80/20 rule").

    The threshold is the ``1 - quantile`` quantile of this micro-batch's completion tokens on **every
    rank** (TRL gathers the processes' micro-batches the same way); the ranks call it together, once per
    micro-batch (collective). Ties at the threshold are kept (``>=``). ``counted`` False: this rank's tokens
    are another's too (a sequence-parallel group holds its micro-batch whole on every rank, the entropies
    gathered from the slices) and stay out of the threshold, which so counts each token once, as at SP 1."""
    local = entropies[mask.bool()].detach().float()  # [n]
    if not counted:
        local = local[:0]
    if dist.is_initialized() and dist.get_world_size() > 1:
        local = _gather_ragged(local)
    if local.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = _quantile(local, 1 - quantile)
    return (entropies >= threshold) & mask.bool()


def _gather_ragged(values: torch.Tensor) -> torch.Tensor:
    """Every rank's ``values [n_r]`` concatenated (``n_r`` may differ): sizes first, then one padded all-gather."""
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long, device=values.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([values.numel()], device=values.device))
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])


def _sequence_mean(per_token, mask, totals, loss):
    return (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / totals.completions


def _micro_batch_mean(per_token, mask, totals, loss):
    return per_token.sum() / mask.sum().clamp(min=1.0) / totals.micro_batches


def _max_tokens(per_token, mask, totals, loss):
    return per_token.sum() / (totals.completions * loss.max_new_tokens)


def _token_mean(per_token, mask, totals, loss):
    return per_token.sum() / torch.as_tensor(totals.tokens, dtype=per_token.dtype).clamp(min=1.0)


# step 5: this micro-batch's share of the optimizer step's loss, by the entry's reduction (the registry's table)
REDUCE: dict[str, Callable] = {"sequence_mean": _sequence_mean, "micro_batch_mean": _micro_batch_mean,
                               "max_tokens": _max_tokens, "token_mean": _token_mean}  # fmt: skip


class GrpoLoss:
    """The loss of ``grpo.loss_type`` (its registry entry) with the ``grpo`` section's clipping, KL and masking."""

    def __init__(self, grpo: GrpoConfig, counts_tokens: bool = True):
        """``counts_tokens``: whether this rank's tokens join the entropy threshold (:func:`high_entropy_mask`);
        under sequence parallelism only a group's first rank's, the others holding the same tokens."""
        entry = policy_loss(grpo.loss_type)
        module, _, name = entry.surrogate.partition(":")
        self.surrogate = getattr(importlib.import_module(module), name)
        self.reduce = REDUCE[entry.reduction]
        self.loss_type, self.beta = grpo.loss_type, grpo.beta
        self.eps_low = grpo.epsilon
        self.eps_high = grpo.epsilon if grpo.epsilon_high is None else grpo.epsilon_high
        self.sequence_level = grpo.importance_sampling_level == "sequence"
        self.max_new_tokens = grpo.max_new_tokens
        self.mask_truncated = grpo.mask_truncated_completions
        self.sapo_temperature_pos, self.sapo_temperature_neg = grpo.sapo_temperature_pos, grpo.sapo_temperature_neg
        self.top_entropy_quantile, self.counts_tokens = grpo.top_entropy_quantile, counts_tokens

    def __call__(
        self,
        logps: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        totals: StepTotals,
        old: torch.Tensor | None = None,
        ref: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        is_ratio: torch.Tensor | None = None,
        entropies: torch.Tensor | None = None,
    ) -> GrpoTerms:
        """``logps``, ``old``, ``ref``, ``mask``, ``entropies``: ``[B, T]``; ``advantages``, ``truncated``: ``[B]``;
        ``is_ratio``: vLLM's importance-sampling weights (:func:`vllm_importance_weights`), or None;
        ``entropies``: the policy's per-token entropies (``top_entropy_quantile < 1`` needs them)."""
        mask = mask.to(logps.dtype)
        if self.mask_truncated and truncated is not None:
            mask = mask * (~truncated).to(mask.dtype)[:, None]
        old = logps.detach() if old is None else old
        log_ratio = logps - old  # [B, T]
        if self.sequence_level:  # GSPO: the mean log-ratio of the completion, one ratio per sequence
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]  # [B, 1]
        terms = self.surrogate(log_ratio, advantages[:, None], self, logps, mask)
        per_token = terms.per_token
        if self.top_entropy_quantile < 1.0:  # step 3, as TRL: before the importance weights and the KL
            if entropies is None:
                raise ValueError("grpo.top_entropy_quantile < 1 needs the policy's per-token entropies")
            per_token = per_token * high_entropy_mask(entropies, mask, self.top_entropy_quantile, self.counts_tokens)
        if is_ratio is not None:
            per_token = per_token * is_ratio  # [B, T] or [B, 1], as TRL: before the KL term
        kl = None
        if self.beta != 0.0:
            if ref is None:
                raise ValueError("grpo.beta > 0 needs the reference's log-probs")
            kl = torch.exp(ref - logps) - (ref - logps) - 1  # [B, T] k3
            per_token = per_token + self.beta * kl
        per_token = per_token * mask  # [B, T]: a sequence-level loss broadcasts over its tokens
        loss = self.reduce(per_token, mask, totals, self)
        return GrpoTerms(loss, kl.detach() if kl is not None else None, terms.ratio, terms.low_clipped,
                         terms.high_clipped, mask)  # fmt: skip


__all__ = ["REDUCE", "STD_EPS", "GrpoLoss", "GrpoTerms", "StepTotals", "Surrogate", "cispo_surrogate", "clipped_surrogate",
           "gmpo_surrogate", "group_advantages", "high_entropy_mask", "sapo_surrogate", "vllm_importance_weights"]
