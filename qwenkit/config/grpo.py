"""``grpo``: reinforcement learning with verifiable rewards (``train.objective: grpo``) and what rollouts cannot go with.

The names and defaults are TRL 1.16's ``GRPOConfig`` (``max_completion_length`` is
``max_new_tokens`` here, as in ``train.eval_max_new_tokens``); the loss is
:mod:`qwenkit.model.losses.policy`, the rewards :mod:`qwenkit.engine.objectives.rewards`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from qwenkit.config.model import Dtype
from qwenkit.config.train import EVAL_METRICS, scorer_problems
from qwenkit.config.vllm import Engine
from qwenkit.model.losses.registry import POLICY_LOSSES

if TYPE_CHECKING:
    from qwenkit.config.schema import Config, Need

log = logging.getLogger(__name__)

GRPO_LOSSES = tuple(POLICY_LOSSES)  # grpo.loss_type: the policy losses registered in qwenkit.model.losses.registry
IMPORTANCE_LEVELS = ("token", "sequence")  # grpo.importance_sampling_level (sequence: GSPO)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL's vllm_importance_sampling_mode
SCALE_REWARDS = ("group", "batch", "none")  # grpo.scale_rewards: the std that divides the advantages
BUILTIN_REWARDS = (*EVAL_METRICS, "format", "iou")  # grpo.rewards besides module:function


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
    epsilon_high: float | None = None  # None: epsilon (DAPO's clip-higher recommends 0.28)
    loss_type: Literal[GRPO_LOSSES] = "dapo"  # how per-token losses are averaged (qwenkit.model.losses.policy)
    importance_sampling_level: Literal[IMPORTANCE_LEVELS] = "token"  # sequence: one ratio per completion (GSPO)
    num_iterations: int = 1  # optimizer updates per batch of rollouts (PPO's mu); > 1 keeps old log-probs
    scale_rewards: Literal[SCALE_REWARDS] = "group"  # divide advantages by the group's std, the batch's, or none (Dr. GRPO)
    mask_truncated_completions: bool = False  # completions cut at max_new_tokens (no EOS) add no loss (DAPO)
    # scores of each completion: exact, normalized, relaxed, anls (as train.eval_metrics), format
    # (the tags below), iou (a box vs the reference box) or module:function(prediction, reference, **row) -> float
    rewards: list[str] = field(default_factory=lambda: ["exact"])
    reward_weights: list[float] = field(default_factory=list)  # one per reward; empty: all 1
    format_tags: list[str] = field(default_factory=lambda: ["think", "answer"])  # format: <think>..</think><answer>..</answer>
    # what samples the completions: hf (generate on the sharded policy) or vllm (a colocated engine per
    # rank, the policy's weights pushed before each rollout; the vllm section)
    rollout_engine: Engine = "hf"
    # hf rollouts' forwards under torch.autocast to this dtype (bfloat16, float16), from the same weights;
    # None: the weights' own. Their log-probs are then corrected for as vLLM's (below)
    rollout_dtype: Dtype | None = None
    # vLLM's (or rollout_dtype's) sampling log-probs differ from the trainer's: weigh each token's loss by
    # exp(trainer's - sampler's log-prob), truncated (or masked) at the clip bounds; TRL's names
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal[IS_MODES] = "token_truncate"  # TRL 1.16's default is sequence_mask
    vllm_importance_sampling_clip_max: float = 3.0  # truncate: ratios capped here; mask: above it, 0
    vllm_importance_sampling_clip_min: float | None = None  # truncate: ratios raised to it; mask: below it, 0


def check(cfg: Config, need: Need) -> None:
    """The ``grpo`` section, and what rollouts cannot go with."""
    grpo = cfg.grpo
    if cfg.train.objective != "grpo":
        default = GrpoConfig()
        changed = [f.name for f in dataclasses.fields(GrpoConfig) if getattr(grpo, f.name) != getattr(default, f.name)]
        need(not changed, f"grpo.{', grpo.'.join(changed)} set but train.objective={cfg.train.objective!r}; set train.objective=grpo")
        return
    need(grpo.num_generations >= 2, f"grpo.num_generations must be >= 2 (advantages compare a group), got {grpo.num_generations}")
    need(grpo.max_new_tokens >= 1, f"grpo.max_new_tokens must be >= 1, got {grpo.max_new_tokens}")
    need(grpo.temperature > 0, f"grpo.temperature must be > 0 (greedy rollouts of a group are all alike), got {grpo.temperature}")
    need(0 < grpo.top_p <= 1, f"grpo.top_p must be in (0, 1], got {grpo.top_p}")
    need(grpo.rollout_batch_size >= 0, f"grpo.rollout_batch_size must be >= 0 (0: all), got {grpo.rollout_batch_size}")
    need(grpo.beta >= 0, f"grpo.beta must be >= 0 (0: no reference), got {grpo.beta}")
    need(grpo.epsilon > 0, f"grpo.epsilon must be > 0, got {grpo.epsilon}")
    if grpo.epsilon_high is not None:
        need(grpo.epsilon_high > 0, f"grpo.epsilon_high must be > 0 (or unset: grpo.epsilon), got {grpo.epsilon_high}")
    need(grpo.num_iterations >= 1, f"grpo.num_iterations must be >= 1, got {grpo.num_iterations}")
    need(
        not grpo.reward_weights or len(grpo.reward_weights) == len(grpo.rewards),
        f"grpo.reward_weights has {len(grpo.reward_weights)} weights for {len(grpo.rewards)} grpo.rewards; "
        "give one per reward or none (all 1)",
    )
    if grpo.reward_weights and not any(grpo.reward_weights):
        log.warning("grpo.reward_weights=%s are all 0: every completion's reward is 0, so no advantage and nothing "
                    "is learnt; give a reward a weight > 0", grpo.reward_weights)  # fmt: skip
    tags = grpo.format_tags
    need(
        len(tags) == 2 and all(t.strip() and "<" not in t and ">" not in t for t in tags) and tags[0] != tags[1],
        f"grpo.format_tags must be two different tag names without brackets (e.g. [think, answer]), got {tags}",
    )
    need(grpo.vllm_importance_sampling_clip_max > 0,
         f"grpo.vllm_importance_sampling_clip_max must be > 0, got {grpo.vllm_importance_sampling_clip_max}")  # fmt: skip
    low = grpo.vllm_importance_sampling_clip_min
    need(low is None or 0 <= low < grpo.vllm_importance_sampling_clip_max,
         f"grpo.vllm_importance_sampling_clip_min must be in [0, vllm_importance_sampling_clip_max) or unset, got {low}")  # fmt: skip
    if grpo.rollout_dtype is not None:
        need(grpo.rollout_dtype != "float32",
             "grpo.rollout_dtype=float32: autocast lowers precision only; unset it to roll out in the weights' own dtype")  # fmt: skip
        need(grpo.rollout_engine == "hf", f"grpo.rollout_dtype={grpo.rollout_dtype} sets the hf rollouts' precision; "
             "vLLM samples in vllm.dtype: unset grpo.rollout_dtype")  # fmt: skip
    need(cfg.loss.chunk, "train.objective=grpo needs loss.chunk=true: the per-token log-probs come from the chunked head")
    need(
        not cfg.data.packing,
        "train.objective=grpo does not support data.packing=true: every completion is its own row of a rollout batch; "
        "use data.packing=false",
    )
    need(
        not cfg.data.max_tokens_per_batch,
        "train.objective=grpo does not support data.max_tokens_per_batch (rollouts are dealt by prompt); "
        "use train.micro_batch_size (prompts per micro-batch)",
    )
    need(
        cfg.parallel.sp_size == 1,
        f"train.objective=grpo does not support parallel.sp_size={cfg.parallel.sp_size}: generation runs whole "
        "sequences on each rank; use parallel.sp_size=1",
    )




def check_rewards(cfg: Config, need: Need) -> None:
    """``grpo.rewards``: built-in names, or functions that import and take ``(prediction, reference, **row)``.
    Apart from :func:`check`: a command that never calls the rewards (``qwenkit eval``, ``export``)
    loads a run's config without importing them (``config.load(..., rewards=False)``)."""
    if cfg.train.objective == "grpo":
        for problem in scorer_problems(cfg.grpo.rewards, "grpo.rewards", BUILTIN_REWARDS, "reward"):
            need(False, problem)
