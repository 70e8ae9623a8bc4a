"""GRPO's metrics, by TRL's names, reduced over the ranks: what :class:`~qwenkit.engine.objectives.grpo.GrpoObjective` logs.

Three kinds, each reduced in one collective: the rollout's (:func:`rollout_metrics`: rewards, their spread, the
groups whose rewards are all equal, completion lengths, the agentic ``tools/*``; over every rank's completions,
gathered once by :func:`gather_named`); the importance sampling of a vLLM or lower-precision rollout
(:class:`ImportanceStats`: ``sampling/*``, over the rollout's completion tokens); and a step's
(:class:`StepMetrics`: ``kl``, ``entropy``, ``clip_ratio/*``, summed over its micro-batches' completion tokens,
or completions at sequence level, and divided once at the end).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from qwenkit.engine.rollouts import agentic

CLIP = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def gather_named(columns: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Every rank's values of each named column ``[n]`` (equal ``n`` on every rank), in rank order, on the CPU:
    one all-gather of the columns stacked in name order."""
    names = sorted(columns)
    mine = torch.stack([columns[k].to(torch.float32) for k in names], dim=1).to(device)  # [n, columns]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
        mine = torch.cat(parts)
    return dict(zip(names, mine.cpu().unbind(1)))


def all_reduce(values: dict[str, torch.Tensor], op=dist.ReduceOp.SUM) -> dict[str, float]:
    """Each named scalar reduced over the ranks by ``op``: one all-reduce of the values stacked in name order."""
    names = sorted(values)
    stacked = torch.stack([values[k] for k in names])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked, op=op)
    return dict(zip(names, stacked.tolist()))


def rollout_metrics(everyone: dict[str, torch.Tensor], zero: torch.Tensor, rewards) -> dict[str, float]:
    """The rollout's metrics from :func:`gather_named`'s columns of every rank's completions; ``zero``: which
    groups' rewards are all equal; ``rewards``: the reward names."""
    total, lengths, truncated = everyone["reward"], everyone["length"], everyone["truncated"]
    out = {"reward": total.mean().item(), "reward_std": total.std().item() if len(total) > 1 else 0.0}
    for name in rewards:
        values = everyone[f"rewards/{name}"]
        out[f"rewards/{name}/mean"] = values.mean().item()
        out[f"rewards/{name}/std"] = values.std().item() if len(values) > 1 else 0.0
    out["frac_reward_zero_std"] = zero.float().mean().item()
    if "tool_calls" in everyone:
        out |= agentic.metrics(everyone)
    out |= {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.mean().item()}  # fmt: skip
    return out


class ImportanceStats:
    """A rollout's importance-sampling statistics, micro-batch by micro-batch (:meth:`add`), reduced once
    (:meth:`metrics`): sums and counts, and the extremes (the minimum as a maximum of ``-x``)."""

    def __init__(self):
        self.sums = dict.fromkeys(("difference", "tokens", "ratio", "ratios"), 0.0)
        self.max = dict.fromkeys(("difference", "ratio", "-ratio"), -math.inf)

    def add(self, diff: torch.Tensor, kept: torch.Tensor) -> None:
        """``diff``: ``|trainer's - sampler's|`` log-prob per completion token; ``kept``: the truncated weights
        (per token, or per completion at sequence level)."""
        if not diff.numel():
            return
        diff, kept = diff.double(), kept.double()
        for name, value in (("difference", diff.sum()), ("tokens", diff.numel()), ("ratio", kept.sum()), ("ratios", kept.numel())):
            self.sums[name] += float(value)
        for name, value in (("difference", diff.max()), ("ratio", kept.max()), ("-ratio", -kept.min())):
            self.max[name] = max(self.max[name], float(value))

    def metrics(self, device) -> dict[str, float]:
        """TRL's names, over every rank's completion tokens (collective)."""
        def on_device(values: dict[str, float]) -> dict[str, torch.Tensor]:
            return {k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in values.items()}
        sums, extremes = all_reduce(on_device(self.sums)), all_reduce(on_device(self.max), op=dist.ReduceOp.MAX)
        return {"sampling/sampling_logp_difference/mean": sums["difference"] / max(sums["tokens"], 1),
                "sampling/sampling_logp_difference/max": extremes["difference"],
                "sampling/importance_sampling_ratio/min": -extremes["-ratio"],
                "sampling/importance_sampling_ratio/mean": sums["ratio"] / max(sums["ratios"], 1),
                "sampling/importance_sampling_ratio/max": extremes["ratio"]}  # fmt: skip


class StepMetrics:
    """A step's KL, entropy and clip shares: each one's sum over the step's completion tokens (or completions,
    sequence level) and its count, micro-batch by micro-batch (:meth:`add`), divided once (:meth:`reduce`)."""

    def __init__(self, device):
        self.sums = {f"{name}/{part}": torch.zeros((), dtype=torch.float64, device=device)
                     for name in ("kl", "entropy", *CLIP) for part in ("sum", "count")}  # fmt: skip
        # the lowest per-completion low-clip share (as the highest of its negative) and the highest high-clip share
        self.extremes = {name: torch.tensor(-torch.inf, dtype=torch.float64, device=device)
                         for name in ("-clip_ratio/low_min", "clip_ratio/high_max")}  # fmt: skip

    def add(self, terms, entropies: torch.Tensor) -> None:
        """One micro-batch's :class:`~qwenkit.model.losses.policy.GrpoLoss` terms and per-token entropies."""
        m = terms.mask
        # token level: the completion's tokens; sequence level: one ratio per completion (TRL's metrics)
        at = m if terms.ratio.shape[1] > 1 else torch.ones_like(terms.ratio)
        low, high = terms.low_clipped.to(at.dtype) * at, terms.high_clipped.to(at.dtype) * at
        kl = (terms.kl * m).sum() if terms.kl is not None else torch.zeros((), device=m.device)
        seen = {"kl": (kl, m.sum()), "entropy": ((entropies * m).sum(), m.sum()), CLIP[0]: (low.sum(), at.sum()),
                CLIP[1]: (high.sum(), at.sum()), CLIP[2]: ((low + high).sum(), at.sum())}  # fmt: skip
        for name, (total, count) in seen.items():
            self.sums[f"{name}/sum"] += total.detach().to(torch.float64)
            self.sums[f"{name}/count"] += count.to(torch.float64)
        per_seq = at.sum(-1).clamp(min=1)
        for name, value in (("-clip_ratio/low_min", -(low.sum(-1) / per_seq).min()),
                            ("clip_ratio/high_max", (high.sum(-1) / per_seq).max())):  # fmt: skip
            self.extremes[name] = torch.maximum(self.extremes[name], value.detach().to(torch.float64))

    def reduce(self, beta: float) -> dict[str, float]:
        """The step's means over every rank (collective); ``kl`` only with a reference (``grpo.beta > 0``)."""
        sums, extremes = all_reduce(self.sums), all_reduce(self.extremes, dist.ReduceOp.MAX)
        out = {name: sums[f"{name}/sum"] / max(sums[f"{name}/count"], 1.0)
               for name in ("kl", "entropy", *CLIP) if name != "kl" or beta > 0}  # fmt: skip
        out["clip_ratio/low_min"], out["clip_ratio/high_max"] = -extremes["-clip_ratio/low_min"], extremes["clip_ratio/high_max"]
        return out


__all__ = ["CLIP", "ImportanceStats", "StepMetrics", "all_reduce", "gather_named", "rollout_metrics"]
