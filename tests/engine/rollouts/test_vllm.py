"""GRPO with vLLM rollouts through the trainer, and evaluation by vLLM (needs vLLM: make test-vllm).

A run on the embedded default (the tiny Qwen2.5-VL, as a new user's run takes it), float32, 1 rank:
rollouts and evaluation from one colocated engine, the policy's weights pushed before each rollout; the
same run on 2 ranks (an engine each, in the gloo group's processes) equals it step for step; a LoRA run's
pushes carry the merged adapters.
Checked: the reward the run optimises rises; at every step the trainer's log-probs of the sampled tokens
equal vLLM's to fp32 ulps (the push carried the weights, both ban the media tokens; the importance-sampling weights are 1), and TRL's
``sampling/*`` metrics are logged; the run's final eval replies (vLLM, after 6 pushes) equal the kit's
HF replies from the exported final weights, and ``qwenkit eval --engine vllm`` gives the same replies.
A MoE run (the tiny Qwen3-VL-MoE, 2 ranks, ``parallel.ep_size=2``, LoRA on the experts): vLLM's log-probs equal the
trainer's after each push of the experts gathered from their mesh, their adapters merged.
On-policy distillation (``train.objective: distill``) rolls out through the same engine: the student's trainer
log-probs equal vLLM's at every step and the teacher's reverse KL is the loss.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: make test-vllm runs these tests in .venv-vllm")

from multiproc import check_ranks  # noqa: E402

from engine.objectives.test_distill import noisy_teacher, train_worker  # noqa: E402
from qwenkit import cli  # noqa: E402
from qwenkit.engine.generation import vllm_engine  # noqa: E402
from qwenkit.engine.objectives import completions  # noqa: E402

STEPS = 6
RUN = ["train.objective=grpo", "data.tiny_samples=16", "data.tiny_eval_samples=4", f"train.steps={STEPS}",
       "train.micro_batch_size=4", "train.lr=0.02", "train.warmup_steps=0", "train.max_grad_norm=0", "train.log_every=1",
       "grpo.num_generations=4", "grpo.max_new_tokens=8", "grpo.rewards=[engine.rollouts.test_vllm:es]",
       "grpo.rollout_engine=vllm", "train.eval_engine=vllm", "train.eval_samples=4", "train.eval_max_new_tokens=8",
       "checkpoint.save_final=true"]  # fmt: skip


def es(prediction: str, reference: str, **row) -> float:
    """A reward the random tiny model can learn in a few steps: the share of ``e`` in the completion."""
    return prediction.count("e") / max(1, len(prediction))


def _engines(out):
    (out / "engines.json").write_text(json.dumps(len(vllm_engine.ENGINES)))


def _worker(rank, out, overrides):
    train_worker(rank, out, overrides, then=_engines)


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


MOE_STEPS = 2  # the second rollout follows a push of moved weights


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """GRPO on the tiny Qwen3-VL-MoE (the vLLM tests' copy: its experts in Qwen's published layout, which vLLM and
    transformers' load both read), float32, 2 steps, on 2 ranks with ``parallel.ep_size=2`` and LoRA on the linears
    and the experts (``lora.target_experts``): each rank trains the adapters of 2 whole experts of each layer, and
    its engine's push gathers all 4 from the ``(efsdp, ep)`` mesh with their adapters merged. (EP 2 = EP 1 for GRPO
    is tests/distributed/test_expert.py's; what is vLLM's here is the push.)"""
    from qwenkit.model.tiny import vllm as tiny_vllm

    out = tmp_path_factory.mktemp("vllm-moe")
    check_ranks(_worker, 2, out, [*RUN, f"model.path={tiny_vllm.ensure_checkpoint('qwen3_vl_moe')}",
                                  f"train.steps={MOE_STEPS}", "train.eval_engine=hf", "train.eval_samples=0",
                                  "checkpoint.save_final=false", "parallel.ep_size=2", "parallel.nproc=2",
                                  "train.micro_batch_size=2", "lora.r=4", "lora.alpha=8", "lora.target_experts=true",
                                  "lora.dropout=0", "train.lr=0.05", f"train.output_dir={out / 'run'}"])  # fmt: skip
    return out


def test_moe_rollouts_log_probs_equal_the_trainers_after_each_push_with_ep2(moe_run):
    """Each step's rollout follows a push of the moved policy, its experts gathered whole and its adapters merged:
    vLLM's log-probs of the sampled tokens equal the trainer's at every step (as the dense run's: fp32 ulps; a stale or misplaced expert
    moves them far more)."""
    history = _history(moe_run)
    assert len(history) == MOE_STEPS and history[0]["grad_norm"] > 0  # the policy moved before the second push
    for step in history:
        assert step["sampling/sampling_logp_difference/max"] < 1e-5, step
        assert step["sampling/importance_sampling_ratio/min"] == pytest.approx(1, abs=1e-5)


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


def test_distillation_rolls_out_on_vllm_and_its_loss_is_the_reverse_kl(tmp_path):
    """Three steps of ``train.objective: distill`` on vLLM rollouts, 1 process: at every step the trainer's
    student log-probs equal vLLM's to fp32 ulps (the importance weights are 1, as GRPO's above), so the loss is
    the reverse KL to the teacher, which is not 0 (another model) and moves the student."""
    run = [*RUN[1:], "train.objective=distill", f"distill.teacher={noisy_teacher(tmp_path)}", "train.steps=3",
           "grpo.rewards=[exact]", "train.eval_engine=hf", "train.eval_samples=0", "data.tiny_eval_samples=0",
           f"train.output_dir={tmp_path / 'run'}"]  # fmt: skip
    check_ranks(_worker, 1, tmp_path, run)
    history = _history(tmp_path)
    assert len(history) == 3
    for step in history:
        assert step["sampling/sampling_logp_difference/max"] < 1e-5, step
        assert step["loss"] == pytest.approx(step["reverse_kl"], rel=1e-4) and step["reverse_kl"] > 0.01, step
        assert step["grad_norm"] > 0 and "rewards/exact/mean" in step
