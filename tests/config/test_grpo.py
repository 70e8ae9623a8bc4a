"""qwenkit.config.grpo: GRPO's settings (train.objective=grpo), their ranges, and what GRPO cannot go with."""

import re

import pytest

from qwenkit import config
from qwenkit.config import ConfigError

GRPO = ["train.objective=grpo"]


def two(prediction, reference):
    """A scorer that takes no row: fine as an eval metric, not as a reward (called with the row's columns)."""
    return 0.0


def nothing():
    return 0.0


def good(prediction, reference, **row):
    return 1.0


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["grpo.beta=0.04"], r"^grpo\.beta set but train\.objective='sft'"),
        (["grpo.rewards=[exact, format]"], r"^grpo\.rewards set but train\.objective='sft'"),
        (GRPO + ["grpo.num_generations=1"], r"grpo\.num_generations must be >= 2"),
        (GRPO + ["grpo.temperature=0"], r"grpo\.temperature must be > 0"),
        (GRPO + ["grpo.top_p=0"], r"grpo\.top_p must be in \(0, 1\]"),
        (GRPO + ["grpo.rollout_batch_size=-1"], r"grpo\.rollout_batch_size must be >= 0"),
        (GRPO + ["grpo.rollout_dtype=float32"], r"grpo\.rollout_dtype=float32: autocast lowers precision only"),
        (GRPO + ["grpo.rollout_dtype=int8"], r"grpo\.rollout_dtype"),
        (GRPO + ["grpo.rollout_dtype=bfloat16", "grpo.rollout_engine=vllm"], r"vLLM samples in vllm\.dtype"),
        (["grpo.rollout_dtype=bfloat16"], r"^grpo\.rollout_dtype set but train\.objective='sft'"),
        (GRPO + ["grpo.routing_replay=true", "grpo.rollout_engine=vllm"],
         r"grpo\.routing_replay=true replays the hf rollouts' routing: vLLM 0\.32 returns routed experts from its GPU"),
        (["grpo.routing_replay=true"], r"^grpo\.routing_replay set but train\.objective='sft'"),
        (GRPO + ["grpo.beta=-0.1"], r"grpo\.beta must be >= 0"),
        (GRPO + ["grpo.epsilon=0"], r"grpo\.epsilon must be > 0"),
        (GRPO + ["grpo.epsilon_high=-1"], r"grpo\.epsilon_high must be > 0"),
        (GRPO + ["grpo.num_iterations=0"], r"grpo\.num_iterations must be >= 1"),
        (GRPO + ["grpo.loss_type=ppo"], r"grpo\.loss_type: got 'ppo', expected one of .*'cispo', 'sapo', 'gmpo'"),
        (GRPO + ["grpo.loss_type=cispo"], r"^grpo\.loss_type=cispo needs grpo\.epsilon_high >= 1: .*recommend 5\.0.*got None$"),
        (GRPO + ["grpo.loss_type=cispo", "grpo.epsilon_high=0.28"], r"^grpo\.loss_type=cispo needs grpo\.epsilon_high >= 1"),
        (GRPO + ["grpo.sapo_temperature_pos=2"], r"^grpo\.sapo_temperature_pos set but grpo\.loss_type='dapo'; only loss_type=sapo reads it$"),
        (GRPO + ["grpo.loss_type=sapo", "grpo.sapo_temperature_neg=0"], r"^grpo\.sapo_temperature_neg must be > 0"),
        (GRPO + ["grpo.loss_type=sapo", "grpo.sapo_temperature_pos=-1"], r"^grpo\.sapo_temperature_pos must be > 0"),
        (["grpo.sapo_temperature_pos=2"], r"^grpo\.sapo_temperature_pos set but train\.objective='sft'"),
        (GRPO + ["grpo.loss_type=gmpo", "grpo.importance_sampling_level=sequence"],
         r"^grpo\.importance_sampling_level=sequence cannot go with grpo\.loss_type=gmpo: GMPO's ratio is already one per completion"),
        (GRPO + ["grpo.loss_type=gmpo", "grpo.top_entropy_quantile=0.2"],
         r"^grpo\.top_entropy_quantile=0\.2 cannot go with grpo\.loss_type=gmpo: the geometric mean ties"),
        (GRPO + ["grpo.top_entropy_quantile=1.5"], r"^grpo\.top_entropy_quantile must be in \[0, 1\]"),
        (GRPO + ["grpo.top_entropy_quantile=-0.1"], r"^grpo\.top_entropy_quantile must be in \[0, 1\]"),
        (GRPO + ["grpo.rewards=[exact, overlong]"], r"^grpo\.rewards has overlong: grpo\.overlong_buffer must be in \[1, grpo\.max_new_tokens=512\].* got 0$"),
        (GRPO + ["grpo.rewards=[overlong]", "grpo.max_new_tokens=8", "grpo.overlong_buffer=9"],
         r"^grpo\.rewards has overlong: grpo\.overlong_buffer must be in \[1, grpo\.max_new_tokens=8\]"),
        (GRPO + ["grpo.overlong_buffer=4"], r"^grpo\.overlong_buffer=4 set but grpo\.rewards=\['exact'\] has no overlong"),
        (GRPO + ["grpo.importance_sampling_level=batch"], r"grpo\.importance_sampling_level"),
        (GRPO + ["grpo.scale_rewards=true"], r"grpo\.scale_rewards"),
        (GRPO + ["grpo.rewards=[]"], r"grpo\.rewards must name at least one reward"),
        (GRPO + ["grpo.rewards=[accuracy]"], r"'accuracy' is neither a built-in reward \(.*format, iou, overlong\) nor module:function"),
        (GRPO + ["grpo.rewards=[no_such_module:f]"], r"'no_such_module:f' does not import"),
        (GRPO + ["grpo.rewards=[exact, exact]"], r"grpo\.rewards: exact given twice"),
        (GRPO + ["grpo.rewards=[config.test_grpo:two]"],
         r"^grpo\.rewards: 'config\.test_grpo:two' takes \(prediction, reference\), but a reward is called as "
         r"two\(prediction, reference, \*\*row\)"),
        (GRPO + ["grpo.rewards=[config.test_grpo:nothing]"],
         r"^grpo\.rewards: 'config\.test_grpo:nothing' takes \(\), but a reward is called as nothing\(prediction, reference, \*\*row\)"),
        (["train.eval_metrics=[config.test_grpo:nothing]"],
         r"^train\.eval_metrics: 'config\.test_grpo:nothing' takes \(\), but a metric is called as nothing\(prediction, reference\)"),
        (GRPO + ["grpo.rewards=[exact, format]", "grpo.reward_weights=[1]"], r"1 weights for 2 grpo\.rewards"),
        (GRPO + ["grpo.format_tags=[think, think]"], r"grpo\.format_tags must be two different tag names"),
        (GRPO + ["grpo.format_tags=[<think>, answer]"], r"grpo\.format_tags must be two different tag names"),
        (GRPO + ["loss.chunk=false"], r"grpo needs loss\.chunk=true"),
        (GRPO + ["data.max_tokens_per_batch=2048"], r"grpo does not support data\.max_tokens_per_batch"),
        (GRPO + ["parallel.nproc=2", "parallel.sp_size=2", "grpo.routing_replay=true"],
         r"parallel\.sp_size=2 with train\.objective=grpo is tested without grpo\.routing_replay=true only"),
    ],
)
def test_grpo_settings_and_what_they_cannot_go_with_are_refused(overrides, pattern):
    assert_refused(overrides, pattern)


def test_the_entropy_threshold_is_valid_under_sequence_parallelism():
    """Each token counted once per SP group (tests/engine/objectives/test_sequence_parallel_rl.py)."""
    cfg = config.load(overrides=GRPO + ["parallel.nproc=2", "parallel.sp_size=2", "grpo.top_entropy_quantile=0.2"])
    assert cfg.grpo.top_entropy_quantile == 0.2


def assert_refused(overrides, pattern):
    """Loading ``overrides`` fails with a line that ``pattern`` matches (searched line by line)."""
    with pytest.raises(ConfigError) as e:
        config.load(overrides=overrides)
    lines = [line.strip(" -").removeprefix("invalid configuration:").strip() for line in str(e.value).splitlines()]
    assert any(re.search(pattern, line) for line in lines), str(e.value)


def test_grpo_settings_in_range_are_valid():
    cfg = config.load(overrides=["lora.r=8"])
    cfg.train.objective = "grpo"
    cfg.grpo = config.GrpoConfig(num_generations=4, beta=0.04, epsilon_high=0.28, loss_type="grpo",
                                 importance_sampling_level="sequence", scale_rewards="none",
                                 rewards=["exact", "format", "iou", "config.test_grpo:good"], reward_weights=[1, 0.5, 1, 0])
    assert config.validate(cfg) == []
    for grpo in (config.GrpoConfig(loss_type="cispo", epsilon_high=5.0, top_entropy_quantile=0.2),
                 config.GrpoConfig(loss_type="sapo", sapo_temperature_pos=0.5, sapo_temperature_neg=2.0),
                 config.GrpoConfig(loss_type="gmpo", epsilon=0.4, rewards=["exact", "overlong"], overlong_buffer=128),
                 config.GrpoConfig(top_entropy_quantile=0.0, rewards=["overlong"], max_new_tokens=8, overlong_buffer=8)):  # fmt: skip
        cfg.grpo = grpo
        assert config.validate(cfg) == [], grpo


def test_a_metric_need_not_take_the_row():
    """An eval metric is called ``f(prediction, reference)``: a function of those two alone is one."""
    assert config.load(overrides=["train.eval_metrics=[config.test_grpo:two]"]).train.eval_metrics == ["config.test_grpo:two"]


def test_all_zero_reward_weights_are_warned_about(caplog):
    """Every completion's reward 0: no advantage, nothing learnt. Valid (a user may switch rewards off
    one by one), so a warning, not a refusal."""
    with caplog.at_level("WARNING"):
        config.load(overrides=GRPO + ["grpo.rewards=[exact, format]", "grpo.reward_weights=[0, 0.0]"])
    assert "grpo.reward_weights=[0.0, 0.0] are all 0: every completion's reward is 0" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        config.load(overrides=GRPO + ["grpo.rewards=[exact, format]", "grpo.reward_weights=[0, 1]"])
    assert "reward_weights" not in caplog.text
