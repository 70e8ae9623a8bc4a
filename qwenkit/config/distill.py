"""``distill``: on-policy distillation (``train.objective: distill``) from a frozen teacher.

The student samples with the ``grpo`` section's sampling keys (:data:`SAMPLING`, the rollouts are
GRPO's); the loss is the per-token reverse KL of the sampled tokens (:mod:`qwenkit.model.losses.distill`).
The ``grpo`` keys of GRPO's loss and advantages (:data:`GRPO_ONLY`) mean nothing here and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

# the grpo keys a distillation run reads: how the student samples, and the rewards it logs (never optimised)
SAMPLING = ("num_generations", "max_new_tokens", "temperature", "top_p", "rollout_batch_size", "rollout_engine",
            "rollout_dtype", "rewards", "reward_weights", "format_tags", "overlong_buffer",
            "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min")  # fmt: skip
# the grpo keys of GRPO's policy loss, its reference and its advantages: refused under train.objective=distill
GRPO_ONLY = ("beta", "epsilon", "epsilon_high", "loss_type", "sapo_temperature_pos", "sapo_temperature_neg",
             "top_entropy_quantile", "importance_sampling_level", "num_iterations", "scale_rewards",
             "mask_truncated_completions", "dynamic_sampling", "max_resample_rounds")  # fmt: skip


@dataclass
class DistillConfig:
    """On-policy distillation (``train.objective: distill``; Thinking Machines' on-policy distillation,
    TRL GKD with ``lmbda=1, beta=1``)."""

    # the teacher: a run folder (its newest complete checkpoint, exported once as <run>/hf-step-N) or
    # a step-N directory, or a Hugging Face checkpoint directory; frozen, sharded as a reference model,
    # of the student's tokenizer (checked before any process starts)
    teacher: str | None = None
