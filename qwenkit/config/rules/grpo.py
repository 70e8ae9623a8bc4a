"""The rules of ``grpo``."""

from __future__ import annotations

import dataclasses
import logging

from qwenkit.config.grpo import BUILTIN_REWARDS, GrpoConfig
from qwenkit.config.schema import Config, Need
from qwenkit.config.train import scorer_problems
from qwenkit.model.losses.registry import POLICY_LOSSES

log = logging.getLogger(__name__)

ROLLOUT_OBJECTIVES = ("grpo", "distill")  # the objectives that roll out with the grpo section's sampling keys


def check(cfg: Config, need: Need) -> None:
    """The ``grpo`` section, and what rollouts cannot go with (GRPO's and distillation's)."""
    grpo, objective = cfg.grpo, cfg.train.objective
    if objective not in ROLLOUT_OBJECTIVES:
        default = GrpoConfig()
        changed = [f.name for f in dataclasses.fields(GrpoConfig) if getattr(grpo, f.name) != getattr(default, f.name)]
        need(not changed, f"grpo.{', grpo.'.join(changed)} set but train.objective={objective!r}; set train.objective=grpo")
        return
    if objective == "grpo":
        need(grpo.num_generations >= 2, f"grpo.num_generations must be >= 2 (advantages compare a group), got {grpo.num_generations}")
    else:  # distill: its own rules say which grpo keys it reads (qwenkit.config.rules.distill)
        need(grpo.num_generations >= 1, f"grpo.num_generations must be >= 1, got {grpo.num_generations}")
    need(grpo.max_new_tokens >= 1, f"grpo.max_new_tokens must be >= 1, got {grpo.max_new_tokens}")
    need(grpo.temperature > 0, f"grpo.temperature must be > 0 (greedy rollouts of a group are all alike), got {grpo.temperature}")
    need(0 < grpo.top_p <= 1, f"grpo.top_p must be in (0, 1], got {grpo.top_p}")
    need(grpo.rollout_batch_size >= 0, f"grpo.rollout_batch_size must be >= 0 (0: all), got {grpo.rollout_batch_size}")
    need(grpo.beta >= 0, f"grpo.beta must be >= 0 (0: no reference), got {grpo.beta}")
    need(grpo.epsilon > 0, f"grpo.epsilon must be > 0, got {grpo.epsilon}")
    if grpo.epsilon_high is not None:
        need(grpo.epsilon_high > 0, f"grpo.epsilon_high must be > 0 (or unset: grpo.epsilon), got {grpo.epsilon_high}")
    need(grpo.num_iterations >= 1, f"grpo.num_iterations must be >= 1, got {grpo.num_iterations}")
    need(grpo.max_resample_rounds >= 0, f"grpo.max_resample_rounds must be >= 0, got {grpo.max_resample_rounds}")
    need(grpo.dynamic_sampling or grpo.max_resample_rounds == GrpoConfig.max_resample_rounds,
         f"grpo.max_resample_rounds={grpo.max_resample_rounds} set but grpo.dynamic_sampling=false; "
         "set grpo.dynamic_sampling=true (or leave grpo.max_resample_rounds unset)")  # fmt: skip
    if objective == "grpo":
        _loss_rules(grpo, need)
    need(0 <= grpo.top_entropy_quantile <= 1,
         f"grpo.top_entropy_quantile must be in [0, 1] (1: every token), got {grpo.top_entropy_quantile}")  # fmt: skip
    if "overlong" in grpo.rewards:
        need(0 < grpo.overlong_buffer <= grpo.max_new_tokens,
             f"grpo.rewards has overlong: grpo.overlong_buffer must be in [1, grpo.max_new_tokens={grpo.max_new_tokens}] "
             f"(the tokens before the limit over which the penalty grows to -1), got {grpo.overlong_buffer}")  # fmt: skip
    else:
        need(grpo.overlong_buffer == 0,
             f"grpo.overlong_buffer={grpo.overlong_buffer} set but grpo.rewards={grpo.rewards} has no overlong; add it")  # fmt: skip
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
    _tool_rules(grpo, need)
    if grpo.routing_replay:
        _routing_rules(cfg, need)
    need(cfg.loss.chunk, f"train.objective={objective} needs loss.chunk=true: the per-token log-probs come from the chunked head")
    need(
        not cfg.data.max_tokens_per_batch,
        f"train.objective={objective} does not support data.max_tokens_per_batch (rollouts are dealt by prompt); "
        "use train.micro_batch_size (prompts per micro-batch)",
    )
    if cfg.parallel.sp_size > 1 and objective == "grpo":
        _sequence_parallel_rules(cfg, need)
    else:
        need(
            cfg.parallel.sp_size == 1,
            f"train.objective={objective} does not support parallel.sp_size={cfg.parallel.sp_size}: generation runs whole "
            "sequences on each rank; use parallel.sp_size=1",
        )


def _sequence_parallel_rules(cfg: Config, need: Need) -> None:
    """``parallel.sp_size > 1``: the rollouts stay whole (each rank of a group generates, the group trains on its
    first rank's), the training forwards run on slices; what is not made exact with it yet is refused."""
    grpo, sp = cfg.grpo, cfg.parallel.sp_size
    unmade = [key for key, on in (("grpo.routing_replay=true", grpo.routing_replay),
                                  ("grpo.tools / grpo.environment", bool(grpo.tools or grpo.environment)),
                                  ("grpo.rollout_engine=vllm", grpo.rollout_engine == "vllm"))
              if on]  # fmt: skip
    need(not unmade, f"parallel.sp_size={sp} with train.objective=grpo is tested without {', '.join(unmade)} only "
         "(the replayed routing, a trajectory's media and vLLM's engines are not made exact on slices); use "
         "parallel.sp_size=1 or leave them out")  # fmt: skip


def _routing_rules(cfg: Config, need: Need) -> None:
    """What ``grpo.routing_replay`` cannot go with (the family's routers: :meth:`qwenkit.model.families.entry.Family.problems`)."""
    grpo = cfg.grpo
    need(grpo.rollout_engine == "hf", "grpo.routing_replay=true replays the hf rollouts' routing: vLLM 0.32 returns "
         "routed experts from its GPU model runner only (not on CPU) and the kit does not read them; set "
         "grpo.rollout_engine=hf")  # fmt: skip
    need(not (grpo.tools or grpo.environment), "grpo.routing_replay=true with grpo.tools / grpo.environment: a "
         "trajectory's later turns re-read its earlier tokens in a new prefill, whose routing is not recorded; "
         "unset one")  # fmt: skip


def _tool_rules(grpo: GrpoConfig, need: Need) -> None:
    """The agentic keys' ranges, and what tools cannot go with (importing them: the launcher's check before spawn,
    :func:`qwenkit.engine.rollouts.tools.problems`)."""
    need(grpo.max_tool_calling_iterations >= 1,
         f"grpo.max_tool_calling_iterations must be >= 1, got {grpo.max_tool_calling_iterations}")  # fmt: skip
    need(grpo.tool_timeout_s > 0, f"grpo.tool_timeout_s must be > 0 (seconds a tool call may run), got {grpo.tool_timeout_s}")
    need(grpo.max_trajectory_tokens >= 0, f"grpo.max_trajectory_tokens must be >= 0 (0: no limit), got {grpo.max_trajectory_tokens}")
    default, agentic = GrpoConfig(), bool(grpo.tools or grpo.environment)
    if not agentic:
        changed = [k for k in ("max_tool_calling_iterations", "tool_timeout_s", "max_trajectory_tokens")
                   if getattr(grpo, k) != getattr(default, k)]  # fmt: skip
        need(not changed, f"grpo.{', grpo.'.join(changed)} set but neither grpo.tools nor grpo.environment; set one")
        return
    need(grpo.rollout_engine == "hf" or grpo.max_trajectory_tokens > 0, "grpo.tools / grpo.environment with "
         "grpo.rollout_engine=vllm need grpo.max_trajectory_tokens > 0: it sizes the engine's sequences (the model's "
         "and the tools' tokens after the prompt)")  # fmt: skip
    need(not grpo.max_trajectory_tokens or grpo.max_trajectory_tokens >= grpo.max_new_tokens,
         f"grpo.max_trajectory_tokens={grpo.max_trajectory_tokens} is below grpo.max_new_tokens={grpo.max_new_tokens}: "
         "it bounds the model's and the tools' tokens together; raise it or set 0 (no limit)")  # fmt: skip


def _loss_rules(grpo: GrpoConfig, need: Need) -> None:
    """What ``grpo.loss_type``'s entry cannot run and the keys other losses alone read (the registry's
    ``refuses`` and ``keys``), and the settings of the new losses."""
    default, entry = GrpoConfig(), POLICY_LOSSES[grpo.loss_type]
    for key, why in entry.refuses:
        value = getattr(grpo, key)
        need(value == getattr(default, key), f"grpo.{key}={value} cannot go with grpo.loss_type={grpo.loss_type}: {why}")
    for name, other in POLICY_LOSSES.items():
        changed = [k for k in other.keys if k not in entry.keys and getattr(grpo, k) != getattr(default, k)]
        need(not changed, f"grpo.{', grpo.'.join(changed)} set but grpo.loss_type={grpo.loss_type!r}; "
             f"only loss_type={name} reads it")  # fmt: skip
    for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
        need(getattr(grpo, key) > 0, f"grpo.{key} must be > 0 (the gate divides by it), got {getattr(grpo, key)}")
    if grpo.loss_type == "cispo":  # TRL's cispo clamps the weight at epsilon_high itself, not at 1 + epsilon_high
        bound = grpo.epsilon_high
        need(bound is not None and bound >= 1,
             f"grpo.loss_type=cispo needs grpo.epsilon_high >= 1: it is the importance weight's upper bound itself "
             f"(TRL's epsilon_max; ScaleRL and TRL recommend 5.0), below 1 even on-policy weights are cut; got {bound}")  # fmt: skip


def check_rewards(cfg: Config, need: Need) -> None:
    """``grpo.rewards``: built-in names, or functions that import and take ``(prediction, reference, **row)``.
    Apart from :func:`check`: a command that never calls the rewards (``qwenkit eval``, ``export``)
    loads a run's config without importing them (``config.load(..., rewards=False)``)."""
    if cfg.train.objective in ROLLOUT_OBJECTIVES:
        for problem in scorer_problems(cfg.grpo.rewards, "grpo.rewards", BUILTIN_REWARDS, "reward"):
            need(False, problem)
