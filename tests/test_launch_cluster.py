"""``qwenkit train`` as clusters start it: torchrun's c10d rendezvous restarting a group whose
rank was killed, and two "nodes" on this machine with the variables Slurm and the Kubeflow
operator set (qwenkit/cluster.py, examples/, docs/CLUSTERS.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from multiproc import free_port, scaled

from qwenkit.engine import events, metrics

ROOT = Path(__file__).resolve().parent.parent
TINY = ["data.tiny_samples=16", "data.tiny_eval_samples=0", "train.eval_samples=0", "train.warmup_steps=2",
        "parallel.allow_oversubscribe=true"]  # fmt: skip
HANG = 300  # seconds (x QWENKIT_TEST_TIMEOUT_SCALE): a run waiting longer has hung


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of rank ``rank`` under ``launcher`` (launcher -> torchrun -> ranks), None before it starts."""
    stack = [launcher]
    while stack:
        pid = stack.pop()
        try:
            stack += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"qwenkit.engine.train" in cmdline and f"RANK={rank}".encode() in env:
            return pid
    return None


def _losses(out: Path) -> list[float]:
    """Rank 0's loss per step, the last row of a step logged twice (the steps redone after a restart)."""
    loss = metrics.series(metrics.read(out), "loss")
    return [loss[step] for step in sorted(loss)]


@pytest.mark.slow
def test_a_killed_rank_restarts_the_c10d_group_which_ends_with_the_uninterrupted_losses(tmp_path):
    steps, run = 6, ["train.steps=6", "checkpoint.every=1", *TINY]
    ref = tmp_path / "ref"
    done = subprocess.run(
        [sys.executable, "-m", "qwenkit.cli", "train", "--config", "params/tiny_cpu.yaml", *run, f"train.output_dir={ref}"],
        cwd=ROOT, capture_output=True, text=True, timeout=scaled(HANG),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "c10d"
    cmd = [sys.executable, "-m", "qwenkit.cli", "train", "--config", "params/tiny_cpu.yaml", *run,
           "parallel.rendezvous=c10d", "parallel.max_restarts=1", f"train.output_dir={out}"]  # fmt: skip
    with open(tmp_path / "stderr", "w") as err:
        job = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + scaled(HANG)
        while not any(e["event"] == "step" and e["step"] >= 2 for e in events.read(out)):  # mid-run
            assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.05)
        victim = _rank_pid(job.pid, 1)
        os.kill(victim, signal.SIGKILL)
        code = job.wait(scaled(HANG))
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    stderr = (tmp_path / "stderr").read_text()
    assert code == 0, stderr[-3000:]
    assert "qwenkit train: the group failed; restart 1 of 1" in stderr
    resumed = events.resumed_step(events.read(out))
    assert resumed is not None and 1 <= resumed < steps, stderr[-3000:]  # the newest checkpoint before the kill
    # the data order and the weights after the restart are the resumed ones: fp32 on the same
    # ranks in the same order, equal to the run that was never interrupted (up to float rounding)
    torch.testing.assert_close(torch.tensor(_losses(out)), torch.tensor(_losses(ref)), rtol=1e-6, atol=0)
    assert len(_losses(out)) == steps
