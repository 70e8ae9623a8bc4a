"""On-policy distillation (``train.objective: distill``): the student samples, a frozen teacher scores the samples.

Thinking Machines' on-policy distillation (Tinker cookbook ``distillation``; TRL GKD's ``lmbda=1,
beta=1`` case, verl's and ms-swift's GKD): the student learns from its own completions, so it is taught
where it goes, and each of their tokens carries its own signal, so it is taught densely. One step:

1. the rollout of GRPO (:class:`~qwenkit.engine.objectives.grpo.GrpoObjective`, whose machinery this
   objective shares): prompts from the sampler, ``grpo.num_generations`` completions of each from the
   student with the ``grpo`` sampling keys (``max_new_tokens``, ``temperature``, ``top_p``,
   ``rollout_engine``: hf or vllm, ``rollout_dtype``), seeded per completion; ``grpo.rewards``, if
   set, score the completions for the metrics only (``reward``, ``rewards/<name>/mean``): nothing
   optimises them;
2. the teacher's per-token log-probs of the sampled tokens, where GRPO computes its reference's
   (``ref_logps``): the teacher is another checkpoint (``distill.teacher``, its HF directory after the
   launcher's :func:`qwenkit.engine.checkpoints.teacher.prepare`), frozen and sharded as GRPO's reference
   (:func:`qwenkit.engine.run.build.teacher_model`), scored through its chunked head under the
   distribution the rollout sampled (the logits over ``grpo.temperature``, the media tokens banned), as
   the student's are: TRL's GKD divides both models' logits by its temperature too;
3. the loss per micro-batch (:func:`qwenkit.model.losses.distill.reverse_kl_loss`): each sampled
   token's reverse-KL sample ``logp_student - logp_teacher`` as a negative advantage, the token mean
   over the step's completion tokens; vLLM's (or a lower-precision rollout's) sampling log-probs are
   corrected for by GRPO's truncated importance weights (``grpo.vllm_importance_sampling_*``).

Metrics: ``reverse_kl`` (the step's mean of the per-token samples over every rank's completion tokens,
the quantity the loss lowers; with importance weights the loss is its weighted mean), ``entropy`` (the
student's, of the sampled distribution), the rollout's ``completions/*``, ``reward``/``rewards/*`` and
``rollout_time`` as GRPO names them, and the importance-sampling metrics when it corrects. The
completions file (``metrics/completions.jsonl``) is GRPO's, the advantage of every line 0.
"""

from __future__ import annotations

import torch
from torch import nn

from qwenkit.engine.objectives import grpo_metrics
from qwenkit.engine.objectives.grpo import GrpoObjective, enable
from qwenkit.engine.rollouts.completion import completion_mask
from qwenkit.engine.run.build import teacher_model
from qwenkit.model.losses.distill import reverse_kl_loss

METRICS = ("reverse_kl", "entropy")  # per completion token, over every rank


class DistillObjective(GrpoObjective):
    """The trainer's hooks for ``train.objective: distill`` (see :mod:`qwenkit.engine.objective`):
    GRPO's rollouts, scored by the teacher, the reverse-KL loss."""

    @staticmethod
    def reference_of(cfg, rt, model: nn.Module) -> nn.Module:
        """The teacher: ``distill.teacher``'s checkpoint, frozen, on the student's meshes."""
        return enable(teacher_model(cfg, rt, model, cfg.distill.teacher))

    def advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """None: the rewards are logged, not optimised (the teacher's log-probs are the signal)."""
        return torch.zeros_like(rewards), torch.zeros_like(rewards, dtype=torch.bool)

    def begin(self, micro: list[dict], counts: torch.Tensor) -> None:
        super().begin(micro, counts)
        self.sums = {f"{name}/{part}": torch.zeros((), dtype=torch.float64, device=self.rt.device)
                     for name in METRICS for part in ("sum", "count")}  # fmt: skip

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        own = {k: v.to(self.rt.device) for k, v in self.queue.pop(0).items()}
        logps, entropies = self.logps(model, batch, entropy=True)
        mask = completion_mask(batch)  # [B, S] the completion tokens
        loss, k = reverse_kl_loss(logps, own["ref_logps"], mask, self.totals.tokens, own.get("is_ratio"))
        m = mask.to(torch.float64)
        for name, values in (("reverse_kl", k), ("entropy", entropies)):
            self.sums[f"{name}/sum"] += (values.detach().to(torch.float64) * m).sum()
            self.sums[f"{name}/count"] += m.sum()
        return loss

    def metrics(self) -> dict[str, float]:
        """The rollout's completion, reward and sampling metrics (GRPO's names), the step's reverse KL and entropy."""
        sums = grpo_metrics.all_reduce(self.sums)
        out = {k: v for k, v in self.rollout_metrics.items() if k != "frac_reward_zero_std"}  # no advantages here
        out |= {name: sums[f"{name}/sum"] / max(sums[f"{name}/count"], 1.0) for name in METRICS}
        out["rollout_time"] = self.rollout_time
        return out
