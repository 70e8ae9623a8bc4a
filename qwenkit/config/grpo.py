"""``grpo``: reinforcement learning with verifiable rewards (``train.objective: grpo``) and what rollouts cannot go with.

The names and defaults are TRL 1.16's ``GRPOConfig`` (``max_completion_length`` is
``max_new_tokens`` here, as in ``train.eval_max_new_tokens``); the loss is
:mod:`qwenkit.model.losses.policy`, the rewards :mod:`qwenkit.engine.objectives.rewards`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from qwenkit.config.model import Dtype
from qwenkit.config.train import EVAL_METRICS
from qwenkit.config.vllm import Engine
from qwenkit.model.losses.registry import POLICY_LOSSES

GRPO_LOSSES = tuple(POLICY_LOSSES)  # grpo.loss_type: the policy losses registered in qwenkit.model.losses.registry
IMPORTANCE_LEVELS = ("token", "sequence")  # grpo.importance_sampling_level (sequence: GSPO)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's vllm_importance_sampling_mode
SCALE_REWARDS = ("group", "batch", "none")  # grpo.scale_rewards: the std that divides the advantages
BUILTIN_REWARDS = (*EVAL_METRICS, "format", "iou", "overlong")  # grpo.rewards besides module:function


@dataclass
class GrpoConfig:
    """Group Relative Policy Optimization (``train.objective: grpo``): TRL's names and defaults."""

    num_generations: int = 8  # completions sampled per prompt (the group whose rewards are compared)
    max_new_tokens: int = 512  # a completion's length limit (TRL's max_completion_length; dr_grpo divides by it)
    temperature: float = 1.0  # sampling temperature of the rollouts (> 0: a group of greedy copies learns nothing)
    top_p: float = 1.0  # nucleus sampling's mass
    rollout_batch_size: int = 0  # completions sampled together in one generate call (0: all of a rank's rollout)
    beta: float = 0.0  # weight of the k3 KL to the reference; 0: no reference is built or run
    epsilon: float = 0.2  # clipping: the ratio is kept within [1 - epsilon, 1 + epsilon_high]
    # None: epsilon (DAPO's clip-higher recommends 0.28); cispo: the IS weight's upper bound itself (TRL's
    # epsilon_max, 5.0); gmpo: epsilon and epsilon_high bound the log-ratio (the paper's 0.4)
    epsilon_high: float | None = None
    loss_type: Literal[GRPO_LOSSES] = "dapo"  # the policy loss and how it is averaged (qwenkit.model.losses.registry)
    sapo_temperature_pos: float = 1.0  # sapo: the gate's temperature where the advantage is > 0 (TRL's name)
    sapo_temperature_neg: float = 1.05  # sapo: ... where it is <= 0
    # only the tokens whose entropy is in this top fraction of the micro-batch's (over every rank) carry
    # the policy loss; 1.0: all ("Beyond the 80/20 rule" recommends 0.2; TRL's name)
    top_entropy_quantile: float = 1.0
    importance_sampling_level: Literal[IMPORTANCE_LEVELS] = "token"  # sequence: one ratio per completion (GSPO)
    num_iterations: int = 1  # optimizer updates per batch of rollouts (PPO's mu); > 1 keeps old log-probs
    scale_rewards: Literal[SCALE_REWARDS] = "group"  # divide advantages by the group's std, the batch's, or none (Dr. GRPO)
    mask_truncated_completions: bool = False  # completions cut at max_new_tokens (no EOS) add no loss (DAPO)
    # DAPO's dynamic sampling (verl's filter_groups, ms-swift's dynamic_sample): groups whose rewards are all
    # equal are dropped and more prompts drawn until the batch is full, at most max_resample_rounds extra
    # draws a rollout (qwenkit.engine.objectives.dynamic_sampling)
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3
    # scores of each completion: exact, normalized, relaxed, anls (as train.eval_metrics), format
    # (the tags below), iou (a box vs the reference box), overlong (DAPO's soft overlong punishment) or
    # module:function(prediction, reference, **row) -> float
    rewards: list[str] = field(default_factory=lambda: ["exact"])
    # overlong: 0 up to max_new_tokens - overlong_buffer tokens, then linearly down to -1 at max_new_tokens
    overlong_buffer: int = 0
    reward_weights: list[float] = field(default_factory=list)  # one per reward; empty: all 1
    format_tags: list[str] = field(default_factory=lambda: ["think", "answer"])  # format: <think>..</think><answer>..</answer>
    # what samples the completions: hf (generate on the sharded policy) or vllm (a colocated engine per
    # rank, the policy's weights pushed before each rollout; the vllm section)
    rollout_engine: Engine = "hf"
    # hf rollouts' forwards under torch.autocast to this dtype (bfloat16, float16), from the same weights;
    # None: the weights' own. Their log-probs are then corrected for as vLLM's (below)
    rollout_dtype: Dtype | None = None
    # agentic rollouts (qwenkit.engine.rollouts.agentic): typed, docstring'd module:function tools (TRL's tools) and/or
    # a module:Class environment, one instance per completion: reset(**row), its public methods tools (TRL's
    # environment_factory); rounds of tool calls per trajectory (TRL's name), a call's time limit, and the whole
    # trajectory's model + tool tokens (0: no limit; max_new_tokens counts the model's)
    tools: list[str] = field(default_factory=list)
    environment: str | None = None
    max_tool_calling_iterations: int = 4
    tool_timeout_s: float = 30.0
    max_trajectory_tokens: int = 0
    # vLLM's (or rollout_dtype's) sampling log-probs differ from the trainer's: weigh each token's loss by
    # exp(trainer's - sampler's log-prob), truncated (or masked) at the clip bounds; TRL's names
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal[IS_MODES] = "token_truncate"  # TRL 1.16's default is sequence_mask
    vllm_importance_sampling_clip_max: float = 3.0  # truncate: ratios capped here; mask: above it, 0
    vllm_importance_sampling_clip_min: float | None = None  # truncate: ratios raised to it; mask: below it, 0
