"""GRPO with vLLM rollouts through the trainer, and evaluation by vLLM (needs vLLM: make test-vllm).

A run on the embedded default (the tiny Qwen2.5-VL, as a new user's run takes it), float32, 1 rank:
rollouts and evaluation from one colocated engine, the policy's weights pushed before each rollout; the
same run on 2 ranks (an engine each, in the gloo group's processes) equals it step for step; a LoRA run's
pushes carry the merged adapters.
Checked: the reward the run optimises rises; at every step the trainer's log-probs of the sampled tokens
equal vLLM's to fp32 ulps (the push carried the weights, both ban the media tokens; the importance-sampling weights are 1), and TRL's
``sampling/*`` metrics are logged; the run's final eval replies (vLLM, after 6 pushes) equal the kit's
HF replies from the exported final weights, and ``qwenkit eval --engine vllm`` gives the same replies.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: make test-vllm runs these tests in .venv-vllm")

import torch.distributed as dist  # noqa: E402
from multiproc import check_ranks  # noqa: E402

from qwenkit import cli  # noqa: E402
from qwenkit import config as qconfig  # noqa: E402
from qwenkit.engine.generation import vllm_engine  # noqa: E402
from qwenkit.engine.objectives import completions  # noqa: E402
from qwenkit.engine.run import train  # noqa: E402

STEPS = 6
RUN = ["train.objective=grpo", "data.tiny_samples=16", "data.tiny_eval_samples=4", f"train.steps={STEPS}",
       "train.micro_batch_size=4", "train.lr=0.02", "train.warmup_steps=0", "train.max_grad_norm=0", "train.log_every=1",
       "grpo.num_generations=4", "grpo.max_new_tokens=8", "grpo.rewards=[engine.rollouts.test_vllm:es]",
       "grpo.rollout_engine=vllm", "train.eval_engine=vllm", "train.eval_samples=4", "train.eval_max_new_tokens=8",
       "checkpoint.save_final=true"]  # fmt: skip


def es(prediction: str, reference: str, **row) -> float:
    """A reward the random tiny model can learn in a few steps: the share of ``e`` in the completion."""
    return prediction.count("e") / max(1, len(prediction))


def _worker(rank, out, overrides):
    dist.init_process_group("gloo")
    trainer = train.Trainer(qconfig.load(overrides=overrides))
    trainer.run()
    if rank == 0:
        (out / "history.json").write_text(json.dumps(trainer.history))
        (out / "engines.json").write_text(json.dumps(len(vllm_engine.ENGINES)))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run on 1 process, 4 prompts a step (``run/``), on 2 ranks, 2 prompts each (``two/``), and with LoRA
    adapters, 3 steps (``lora/``)."""
    out = tmp_path_factory.mktemp("vllm-grpo")
    check_ranks(_worker, 1, out, [*RUN, f"train.output_dir={out / 'run'}"])
    two = out / "two"
    two.mkdir()
    check_ranks(_worker, 2, two, [*RUN, f"train.output_dir={two / 'run'}", "train.micro_batch_size=2"])
    adapters = out / "lora"
    adapters.mkdir()
    check_ranks(_worker, 1, adapters, [*RUN, f"train.output_dir={adapters / 'run'}", "lora.r=8",
                                       "train.steps=3", "train.eval_samples=0", "train.lr=0.05"])  # fmt: skip
    return out


def _history(run) -> list[dict]:
    return json.loads((run / "history.json").read_text())


def test_the_reward_rises_with_vllm_rollouts(run):
    rewards = [h["reward"] for h in _history(run)]
    assert len(rewards) == STEPS
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2, rewards


def test_two_ranks_equal_one_process(run):
    """Each rank pushes its shards' gathered weights into its own engine, and a row's completions depend on its
    seed alone: 2 ranks sample, score and train what 1 process does."""
    timing = ("step_time", "tokens_per_s", "samples_per_s", "peak_memory", "padding_fraction", "eval_generation_time",
              "rollout_time")
    for a, b in zip(_history(run / "two"), _history(run), strict=True):
        assert a.keys() == b.keys()
        for k in a.keys() - set(timing):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k  # fp32: the gradients summed in another order


@pytest.mark.parametrize("name", ["", "lora"])
def test_the_trainers_log_probs_equal_vllms_after_each_push(run, name):
    """With LoRA the push merges each adapter into its base weight; the policy trains them unmerged."""
    history = _history(run / name)
    names = {f"sampling/sampling_logp_difference/{s}" for s in ("mean", "max")}
    names |= {f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max")}
    assert names <= set(history[0])
    assert history[-1]["grad_norm"] > 0 and history[-1]["reward"] != history[0]["reward"]  # the policy moved
    # fp32, the same weights at every rollout. vLLM's log-probs are its sampler's (processed_logprobs: after the
    # temperature, media tokens banned by logit_bias -100, e^-100 of their mass left), the trainer's those of the same
    # distribution (the media tokens banned): they differ by fp32 rounding of other kernels, a few ulps of log-probs
    # near -log V = -7 (an ulp there is 4.8e-7; seen: 9.5e-7); a rollout from stale weights, or the unbanned
    # distribution (-log(1 - the media tokens' mass), ~1e-2 on the tiny model), differs far more
    for step in history:
        assert step["sampling/sampling_logp_difference/max"] < 1e-5, step
        assert step["sampling/importance_sampling_ratio/min"] == pytest.approx(1, abs=1e-5)
        assert step["sampling/importance_sampling_ratio/max"] == pytest.approx(1, abs=1e-5)
    lines = completions.read_completions(run / "run")[1]
    assert len(lines) == 4 * 4 and all(line["completion"] is not None for line in lines)


def test_final_eval_replies_equal_the_kits_hf_replies_and_qwenkit_eval_vllm(run, capsys):
    assert json.loads((run / "engines.json").read_text()) == 1  # rollouts and evaluation share the rank's engine
    final = [json.loads(line) for line in (run / "run" / "eval" / f"step-{STEPS:06d}.jsonl").read_text().splitlines()]
    assert len(final) == 4
    replies = {}
    for engine in ("hf", "vllm"):
        out = run / f"cli-{engine}.jsonl"
        args = cli.build_parser().parse_args(["eval", str(run / "run"), "--engine", engine, "--out", str(out)])
        assert args.func(args) == 0
        replies[engine] = [json.loads(line)["tokens"] for line in out.read_text().splitlines()]
    assert replies["vllm"] == replies["hf"] == [r["tokens"] for r in final]
    first = [json.loads(line) for line in (run / "run" / "eval" / "step-000000.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in first] != replies["hf"]  # training moved the replies: the pushes carried it
