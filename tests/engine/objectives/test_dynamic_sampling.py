"""DAPO's dynamic sampling (``grpo.dynamic_sampling``): groups whose rewards are all equal are dropped and
more prompts drawn until the batch is full; the first round draws what a run without it draws, a resumed run
equals the uninterrupted one bit for bit, and 2 ranks agree on the rounds (no rank waits on another's draw).

The reward :func:`half_constant` is constant on about half of the tiny task's prompts (by a hash of the
reference), so their groups teach nothing; on the others it is :func:`test_grpo.vowels`, which the random
tiny model's completions differ by.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
import torch.distributed as dist
from multiproc import check_ranks

from engine.objectives.test_grpo import vowels
from qwenkit import config as qconfig
from qwenkit.config import ConfigError
from qwenkit.engine.objectives import completions
from qwenkit.engine.objectives.dynamic_sampling import Round, fill, informative
from qwenkit.engine.run import train

BASE = ["train.objective=grpo", "data.tiny_samples=16", "train.steps=2", "train.max_grad_norm=0", "train.lr=0.01",
        "train.warmup_steps=0", "grpo.num_generations=4", "grpo.max_new_tokens=6",
        "grpo.rewards=[engine.objectives.test_dynamic_sampling:half_constant]", "checkpoint.save_final=false",
        "train.resume=auto", "train.log_every=1"]  # fmt: skip
DYNAMIC = ["grpo.dynamic_sampling=true", "grpo.max_resample_rounds=4"]
TIMING = ("step_time", "tokens_per_s", "samples_per_s", "peak_memory", "rollout_time")


def half_constant(prediction: str, reference: str, **row) -> float:
    """0 for every completion of a prompt whose reference hashes even; else the completion's share of vowels."""
    return 0.0 if zlib.crc32(reference.encode()) % 2 == 0 else vowels(prediction, reference, **row)


def _round(rewards: list[list[float]], first_index: int = 0) -> Round:
    """A fake draw: one group per list of rewards, each completion's index its group's."""
    total = torch.tensor([float(r) for group in rewards for r in group])
    done = [first_index + j for j, group in enumerate(rewards) for _ in group]  # stand-ins for Completions
    return Round(done, total[:, None], total, [0] * len(done))


def test_a_group_is_informative_when_its_rewards_differ():
    assert informative(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), 2).tolist() == [False, True, False]


def test_fill_keeps_the_informative_groups_in_draw_order_and_draws_until_full():
    rounds = iter([_round([[1, 1], [0, 1], [2, 2], [0, 3]]), _round([[5, 5], [1, 2], [0, 4], [7, 7]], first_index=4)])
    batch, metrics = fill(lambda: next(rounds), 2, max_rounds=3, device="cpu")
    assert batch.done == [1, 1, 3, 3, 5, 5, 6, 6]  # round 1's informative groups, then round 2's first two
    assert batch.total.tolist() == [0, 1, 0, 3, 1, 2, 0, 4]
    assert metrics == {"dynamic_sampling/frac_reward_zero_std_drawn": 0.5, "dynamic_sampling/rounds": 2.0,
                       "dynamic_sampling/extra_prompts": 4.0}  # fmt: skip


def test_fill_stops_after_max_rounds_and_completes_the_batch_with_the_dropped_groups():
    rounds = iter([_round([[1, 1], [0, 1]]), _round([[2, 2], [3, 3]], first_index=2)])
    batch, metrics = fill(lambda: next(rounds), 2, max_rounds=1, device="cpu")
    assert batch.done == [1, 1, 0, 0]  # the one informative group, then the first dropped one
    assert metrics["dynamic_sampling/rounds"] == 2 and metrics["dynamic_sampling/extra_prompts"] == 2
    with pytest.raises(StopIteration):
        next(rounds)  # no third draw


@pytest.mark.parametrize("overrides, problem", [
    (["grpo.max_resample_rounds=2"], "grpo.max_resample_rounds=2 set but grpo.dynamic_sampling=false"),
    (["grpo.dynamic_sampling=true", "grpo.max_resample_rounds=-1"], "grpo.max_resample_rounds must be >= 0, got -1"),
])  # fmt: skip
def test_bad_dynamic_sampling_settings_are_refused_before_the_start(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        qconfig.load(overrides=["train.objective=grpo", *overrides])


def _worker(rank, out, runs):
    dist.init_process_group("gloo")
    for name, extra in runs:
        trainer = train.Trainer(qconfig.load(overrides=BASE + extra + [f"train.output_dir={out / name}"]))
        trainer.run()
        if rank == 0:
            path = out / f"{name}.json"
            before = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps(before + [{k: v for k, v in h.items() if k not in TIMING} for h in trainer.history]))
        dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def out(tmp_path_factory, tiny_path):
    """plain: without dynamic sampling; dynamic: with it; resumed: the same, stopped after step 1 and run
    again; two: with it on 2 ranks (1 prompt each)."""
    out = tmp_path_factory.mktemp("dynamic")
    one = ["train.micro_batch_size=2"]
    cut = [*one, *DYNAMIC, "checkpoint.save_final=true"]
    check_ranks(_worker, 2, out, [("two", ["train.micro_batch_size=1", *DYNAMIC])])
    check_ranks(_worker, 1, out, [("plain", one), ("dynamic", [*one, *DYNAMIC]), ("resumed", [*cut, "train.stop_after=1"]),
                                  ("resumed", cut)])  # fmt: skip
    return out


def _history(out, name):
    return list({h["step"]: h for h in json.loads((out / f"{name}.json").read_text())}.values())


@pytest.mark.slow
def test_the_trained_groups_are_informative_and_the_first_round_is_the_plain_runs_draw(out):
    plain, dynamic = _history(out, "plain"), _history(out, "dynamic")
    assert max(step["frac_reward_zero_std"] for step in plain) > 0  # the reward leaves groups with nothing to teach
    # the first step's first round draws the rows and seeds the run without dynamic sampling draws
    assert dynamic[0]["dynamic_sampling/frac_reward_zero_std_drawn"] == plain[0]["frac_reward_zero_std"]
    assert max(step["dynamic_sampling/rounds"] for step in dynamic) >= 2  # some step drew again
    for step in dynamic:
        assert step["frac_reward_zero_std"] == 0 and step["dynamic_sampling/rounds"] >= 1
        assert step["dynamic_sampling/extra_prompts"] == 2 * (step["dynamic_sampling/rounds"] - 1)
    for lines in completions.read_completions(out / "dynamic").values():
        rewards: dict[int, set[float]] = {}
        for line in lines:
            rewards.setdefault(line["index"], set()).add(line["reward"])
        assert all(len(r) > 1 for r in rewards.values())  # no logged group has equal rewards


@pytest.mark.slow
def test_a_resumed_run_with_dynamic_sampling_equals_the_uninterrupted_one(out):
    assert _history(out, "resumed") == _history(out, "dynamic")
    assert completions.read_completions(out / "resumed") == completions.read_completions(out / "dynamic")


@pytest.mark.slow
def test_two_ranks_agree_on_the_rounds_and_fill_with_dropped_groups_only_when_the_rounds_run_out(out):
    """Every rank draws as many rounds (or the run would hang in the rollout's gather); a rank still short after
    the last round trains on the groups it dropped: 1 + grpo.max_resample_rounds rounds then."""
    last = 1 + 4
    for step in _history(out, "two"):
        rounds = step["dynamic_sampling/rounds"]
        assert 1 <= rounds <= last and step["dynamic_sampling/extra_prompts"] == 2 * (rounds - 1)  # both ranks' rows
        assert step["frac_reward_zero_std"] <= step["dynamic_sampling/frac_reward_zero_std_drawn"]
        if rounds < last:
            assert step["frac_reward_zero_std"] == 0
