"""qwenkit.config.distill: on-policy distillation's settings (train.objective=distill), and what it refuses: no
teacher, a teacher for another objective, the grpo keys of GRPO's loss, reference and advantages, and tools."""

import pytest

from config.test_grpo import assert_refused
from qwenkit import config
from qwenkit.config.distill import GRPO_ONLY, SAMPLING
from qwenkit.config.grpo import GrpoConfig
from qwenkit.model.families.entry import NOT_EXACT

DISTILL = ["train.objective=distill", "distill.teacher=/some/teacher"]


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["train.objective=distill"], r"^train\.objective=distill needs distill\.teacher: a run folder, a step-N directory"),
        (["distill.teacher=/t"], r"^distill\.teacher='/t' set but train\.objective='sft'; set train\.objective=distill$"),
        (["train.objective=grpo", "distill.teacher=/t"], r"^distill\.teacher='/t' set but train\.objective='grpo'"),
        (DISTILL + ["grpo.beta=0.04"], r"^grpo\.beta set but train\.objective=distill reads only the grpo sampling and "
                                       r"reward keys \(its loss is the reverse KL to distill\.teacher, no advantages\); unset it$"),
        (DISTILL + ["grpo.loss_type=cispo", "grpo.epsilon_high=5"], r"^grpo\.epsilon_high, grpo\.loss_type set but .*; unset them$"),
        (DISTILL + ["grpo.num_iterations=2"], r"^grpo\.num_iterations set but train\.objective=distill"),
        (DISTILL + ["grpo.dynamic_sampling=true"], r"^grpo\.dynamic_sampling set but train\.objective=distill"),
        (DISTILL + ["grpo.top_entropy_quantile=0.2"], r"^grpo\.top_entropy_quantile set but train\.objective=distill"),
        (DISTILL + ["grpo.tools=[config.test_distill:add]"],
         r"^grpo\.tools cannot go with train\.objective=distill: the teacher scoring multi-turn trajectories .* is not built; unset it$"),
        (DISTILL + ["grpo.num_generations=0"], r"^grpo\.num_generations must be >= 1, got 0$"),
        (DISTILL + ["grpo.temperature=0"], r"^grpo\.temperature must be > 0"),
        (DISTILL + ["loss.chunk=false"], r"^train\.objective=distill needs loss\.chunk=true"),
        (DISTILL + ["parallel.nproc=2", "parallel.sp_size=2"], r"^train\.objective=distill does not support parallel\.sp_size=2"),
    ],
)
def test_what_distillation_cannot_go_with_is_refused_naming_it(overrides, pattern):
    assert_refused(overrides, pattern)


def add(a: int, b: int) -> int:
    """A tool (typed, documented): refused under distillation all the same."""
    return a + b


def test_the_sampling_and_reward_keys_are_valid_and_one_generation_is_enough():
    """Distillation compares no group: one completion a prompt is valid (GRPO needs 2); the sampling and reward keys
    are read, not refused."""
    cfg = config.load(overrides=DISTILL + ["grpo.num_generations=1", "grpo.max_new_tokens=8", "grpo.temperature=0.7",
                                           "grpo.top_p=0.9", "grpo.rewards=[exact, format]", "grpo.reward_weights=[1, 0]",
                                           "lora.r=8", "data.packing=true"])  # fmt: skip
    assert cfg.distill.teacher == "/some/teacher" and cfg.grpo.num_generations == 1


def test_every_grpo_key_is_read_or_refused_by_distillation():
    """A new grpo key must be sorted: into the sampling keys distillation reads, GRPO's own it refuses, or the
    agentic ones (refused by name, their ranges GRPO's)."""
    agentic = {"tools", "environment", "max_tool_calling_iterations", "tool_timeout_s", "max_trajectory_tokens"}
    assert set(GrpoConfig.__dataclass_fields__) == set(SAMPLING) | set(GRPO_ONLY) | agentic
    assert not set(SAMPLING) & set(GRPO_ONLY)


def test_a_family_that_has_not_made_grpo_exact_cannot_distill_either():
    """Distillation's rollouts and log-probs are GRPO's: a family entry's ``not_exact`` GRPO refuses it too, naming it."""
    key, on = NOT_EXACT["GRPO"]
    cfg = config.load(overrides=DISTILL)
    assert on(cfg) and key(cfg) == "train.objective=distill"
    assert not on(config.load())
