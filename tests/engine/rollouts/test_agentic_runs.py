"""Agentic GRPO through the trainer (issue 61), on a tiny checkpoint that calls a tool (:mod:`tool_caller`), so
trajectories take tool turns with images: 2 gloo ranks equal 1 process on the same prompts and seeds, and a
``qwenkit train`` job sent SIGTERM while a multi-turn rollout is in flight (a tool call held open) saves, exits
resumable, and resumed trains the steps the uninterrupted job trains, bit for bit.

Why 2 ranks = 1 holds for trajectories (``qwenkit/engine/rollouts/agentic.py``): each trajectory's turns draw from
generators seeded by the run, the draw, its row, its number in the group and the turn, never by its rank or the
rows batched beside it (``test_agentic.py::test_a_trajectory_does_not_depend_on_the_rows_rolled_out_beside_it``);
every rank takes as many turns as the busiest. The losses then differ by the reduction order of fp32 sums only.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from conftest import assert_same_runs
from jobs import EXIT_RESUMABLE, Job, checkpoints, train
from multiproc import check_ranks, scaled
from tool_caller import ENV, PAUSE_ENV, calling_checkpoint

from qwenkit import config as qconfig
from qwenkit.engine.objectives import completions
from qwenkit.engine.run import events, metrics
from qwenkit.engine.run import train as qtrain

TIMING = ("step_time", "tokens_per_s", "samples_per_s", "peak_memory", "rollout_time")


def agentic(path) -> list[str]:
    """The agentic run of these tests: 2 prompts a step, 2 trajectories each, up to 2 rounds of calls; a small lr
    (at 0.01 the caller stops calling after one step) so every step's trajectories take tool turns."""
    return ["train.objective=grpo", f"model.path={path}", "data.tiny_samples=8", "data.tiny_eval_samples=0",
            "train.eval_samples=0", "train.max_grad_norm=0", "train.lr=1.0e-4", "train.warmup_steps=0",
            "grpo.num_generations=2", "grpo.max_new_tokens=64", "grpo.max_trajectory_tokens=256",
            "grpo.max_tool_calling_iterations=2", "grpo.tool_timeout_s=300", f"grpo.environment={ENV}",
            "grpo.rewards=[qwenkit.model.tiny.agentic:zoomed, engine.objectives.test_grpo:vowels]",
            "grpo.beta=0.0", "checkpoint.save_final=false", "train.log_every=1"]  # fmt: skip


@pytest.fixture(scope="module")
def caller(_cache):
    return calling_checkpoint()


def _worker(rank, out, name, extra):
    dist.init_process_group("gloo")
    logging.getLogger("qwenkit").addHandler(logging.FileHandler(out / f"warnings-{rank}.log"))
    trainer = qtrain.Trainer(qconfig.load(overrides=extra + [f"train.output_dir={out / name}"]))
    trainer.run()
    if rank == 0:
        (out / f"{name}.json").write_text(json.dumps([{k: v for k, v in h.items() if k not in TIMING}
                                                      for h in trainer.history]))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_agentic_trajectories(tmp_path, caller):
    """Step 1 and 2's loss, grad norm, rewards and tools/* metrics of 2 ranks (1 prompt each) equal 1 process's
    (both prompts), and rank 0's trajectories (replies, calls, tool responses, images) are the 1 process's."""
    base = agentic(caller) + ["train.steps=2"]
    check_ranks(_worker, 2, tmp_path, "two", base + ["train.micro_batch_size=1"])
    check_ranks(_worker, 1, tmp_path, "one", base + ["train.micro_batch_size=2"])
    two, one = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("two", "one"))
    assert [h["step"] for h in two] == [1, 2] and two[0]["tools/call_frequency"] > 0 and two[0]["tools/turns_mean"] > 1
    assert two[0]["tools/tool_tokens_mean"] > 0 and two[0]["grad_norm"] > 0
    assert_same_runs(two, one)  # one micro-batch of 4 trajectories pads more than two of 2
    mine, every = (completions.read_completions(tmp_path / n) for n in ("two", "one"))
    for step, lines in mine.items():
        theirs = {(r["index"], r["k"] % 2): r for r in every[step]}  # a group's 2 completions in order
        for r in lines:
            want = theirs[(r["index"], r["k"] % 2)]
            assert r["messages"] == want["messages"] and r["turns"] == want["turns"], (step, r["index"])
    assert any(m["role"] == "tool" for lines in mine.values() for r in lines for m in r["messages"])


def _wait(found, what: str, job: Job, timeout: float = 240):
    deadline = time.monotonic() + scaled(timeout)
    while time.monotonic() < deadline:
        if got := found():
            return got
        assert job.proc.poll() is None, f"exited {job.proc.returncode} before {what}:\n{job.text('stderr')[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {scaled(timeout)} s")


def _steps(run) -> dict[str, dict[int, float]]:
    """Every non-timing metric of rank 0 by step (a step run twice keeps its last run)."""
    rows = metrics.read(run / "metrics" / "rank-00000.jsonl")
    return {name: metrics.series(rows, name) for name in {r["metric"] for r in rows} - set(TIMING)}


@pytest.mark.slow
@pytest.mark.long
def test_sigterm_while_a_multi_turn_rollout_is_in_flight_resumes_as_the_uninterrupted_run(tmp_path, caller, monkeypatch):
    """A 2-rank ``qwenkit train`` of 3 steps: the first tool call of its first rollout is held open, the launcher
    gets SIGTERM, the call returns. The job finishes that step (the rollout's other turns, then the update), saves,
    exits 75; run again it trains the rest. Every step's metrics and trajectories equal an uninterrupted job's."""
    args = [*agentic(caller), "train.steps=3", "train.micro_batch_size=1"]
    tests = str(Path(__file__).resolve().parents[2])  # the ranks import tool_caller's environment
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH", "")) if p))
    whole = train(tmp_path / "whole", *args)
    assert whole.returncode == 0, whole.stderr[-3000:]

    pause = tmp_path / "pause"
    pause.mkdir()
    (pause / "armed").touch()  # armed from the start: the job's first call is held, whatever the machine's speed
    monkeypatch.setenv(PAUSE_ENV, str(pause))
    out = tmp_path / "cut"
    job = Job(out, *args)
    _wait(lambda: (pause / "paused").exists(), "a held tool call", job)
    in_flight = max((e["step"] for e in events.read(out) if e["event"] == "step"), default=0) + 1
    os.kill(job.proc.pid, signal.SIGTERM)
    time.sleep(scaled(3))  # the signal reaches the ranks (launcher, torchrun, ranks) while the call is held
    (pause / "go").touch()
    code = job.wait()
    assert code == EXIT_RESUMABLE, job.text("stderr")[-3000:]
    stopped = events.last(events.read(out), "stopped")
    # step 1's rollout (or, where none of its 4 trajectories called, about 1 in 250, step 2's): resumable either way
    assert in_flight < 3 and stopped["step"] == in_flight and stopped["signal"] == "SIGTERM"
    assert checkpoints(out) == [in_flight]
    again = train(out, *args)
    assert again.returncode == 0, again.stderr[-3000:]

    want, got = _steps(tmp_path / "whole"), _steps(out)
    assert want == got and sorted(want["loss"]) == [1, 2, 3]
    assert want["tools/call_frequency"][in_flight] > 0 and want["tools/turns_mean"][in_flight] > 1  # multi-turn
    assert completions.read_completions(out) == completions.read_completions(tmp_path / "whole")
