"""Agentic GRPO on the vLLM engine (issue 61; needs vLLM: make test-vllm): trajectories of a tiny checkpoint that calls a
tool (:mod:`tool_caller`), each turn one vLLM request per live trajectory, token in and token out; 2 ranks (an engine
each) equal 1 process.

The reference is the trainer: at every step its fp32 log-probs of every sampled token, those after a tool's image turn
included, equal the log-probs vLLM sampled them with (``sampling/sampling_logp_difference/max``, as
``test_vllm.py`` checks single replies), so the training row (ids, tool image pixels, mRoPE positions) is the context
vLLM sampled in; vLLM's expanded prompt equals the kit's ids at every turn (``check_prompts``, or the run stops).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: make test-vllm runs these tests in .venv-vllm")

from multiproc import check_ranks  # noqa: E402
from tool_caller import calling_checkpoint  # noqa: E402

from engine.rollouts.test_agentic_runs import _worker, agentic  # noqa: E402
from qwenkit.engine.objectives import completions  # noqa: E402


@pytest.fixture(scope="module")
def out(tmp_path_factory, _cache):
    """The run on 1 process, 2 prompts a step (``vllm``), and on 2 ranks, 1 prompt each (``two``): an engine each."""
    out = tmp_path_factory.mktemp("vllm-agentic")
    run = [*agentic(calling_checkpoint()), "grpo.rollout_engine=vllm", "train.steps=2"]
    check_ranks(_worker, 1, out, "vllm", [*run, "train.micro_batch_size=2"])
    check_ranks(_worker, 2, out, "two", [*run, "train.micro_batch_size=1"])
    return out


def test_agentic_trajectories_on_vllm_train_on_the_log_probs_vllm_sampled(out):
    history = json.loads((out / "vllm.json").read_text())
    assert history[0]["tools/call_frequency"] > 0 and history[0]["tools/turns_mean"] > 1
    assert history[0]["tools/tool_tokens_mean"] > 0 and history[-1]["grad_norm"] > 0
    for step in history:  # fp32 on both sides: a few ulps of log-probs near -log V (test_vllm.py)
        assert step["sampling/sampling_logp_difference/max"] < 1e-5, step
    lines = [r for lines in completions.read_completions(out / "vllm").values() for r in lines]
    tool = [p for r in lines for m in r["messages"] if m["role"] == "tool" for p in m["content"]]
    assert tool and all(p["type"] == "image" and (out / "vllm" / "metrics" / p["file"]).is_file() for p in tool)


def test_two_ranks_equal_one_process_on_vllm_trajectories(out):
    """Each rank's engine samples its trajectories' turns from their own seeds: 2 ranks roll out and train what 1
    process does (fp32: the gradients summed in another order, as test_vllm.py's single replies)."""
    two, one = (json.loads((out / f"{n}.json").read_text()) for n in ("two", "vllm"))
    assert two[0]["tools/turns_mean"] > 1
    for a, b in zip(two, one, strict=True):
        assert a.keys() == b.keys()
        for k in a.keys() - {"padding_fraction"}:  # vLLM's log-prob differences to the trainer's: ulps of either batch
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-5 if k.startswith(("sampling/", "ratio/")) else 1e-6), k
