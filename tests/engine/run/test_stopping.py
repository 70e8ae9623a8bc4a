"""qwenkit.engine.run.stopping: stop requests (SIGTERM, SIGINT, SIGUSR1) to real ``qwenkit train`` jobs on 2 gloo
ranks, to the launcher, one rank or PID 1 of a container; the save they end with and the exit code a scheduler
requeues on; one job per run folder (issue #23).

Signals go to the real launcher, torchrun and rank processes (found through ``/proc``, :mod:`jobs`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from jobs import (
    EXIT_RESUMABLE,
    STEPS,
    Job,
    checkpoints,
    children,
    gone,
    invocation,
    rank_pids,
    refused,
    train,
)

from qwenkit import config as qconfig
from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.checkpoints import resume
from qwenkit.engine.run import events, stopping


@pytest.mark.slow
def test_sigterm_saves_and_exits_resumable_and_a_second_job_in_the_folder_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    job = Job(out)
    ranks, torchrun = job.running()
    # a second job into the same folder, another seed: refused, naming the first; nothing written
    capsys.readouterr()
    assert refused(out, "train.seed=7") == 2
    second = capsys.readouterr()
    assert "is in use by another qwenkit train" in second.err and f"pid {job.proc.pid}" in second.err
    assert "torchrun" not in second.out
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == 42
    assert len(second.err.strip().splitlines()) == 1, second.err

    os.kill(job.proc.pid, signal.SIGTERM)
    code = job.wait()
    assert code == EXIT_RESUMABLE, job.text("stderr")[-3000:]
    steps = checkpoints(out)
    assert len(steps) == 1 and steps[0] >= 2 and steps[0] == job.step()  # the step it was in, finished
    stopped = events.last(events.read(out), "stopped")
    assert stopped == {**stopped, "step": steps[0], "reason": "signal", "signal": "SIGTERM", "exit_code": EXIT_RESUMABLE}
    for rank in (0, 1):
        log = (out / "logs" / f"rank-0000{rank}.log").read_text()
        assert f"stopped by SIGTERM after step {steps[0]} of {STEPS}" in log, log[-2000:]
    assert gone([*ranks.values(), *torchrun], timeout=30)
    assert "Traceback" not in job.text("stderr")
    assert not list(out.glob(".config-*.yaml"))  # the ranks' own copy of the config is gone with them
    # the lock went with the job: the folder takes a new one (which resumes where it stopped)
    before = len(events.read(out))
    again = train(out, f"train.steps={steps[0] + 1}")
    assert again.returncode == 0, again.stderr[-3000:]
    resumed = events.last(invocation(out, before), "resumed")
    assert resumed == {**resumed, "step": steps[0], "checkpoint": str(ckpt.step_dir(ckpt.checkpoint_root(out), steps[0]))}


@pytest.mark.slow
@pytest.mark.parametrize("sig, background", [(signal.SIGINT, False), (signal.SIGUSR1, True)])
def test_sigint_and_sigusr1_save_with_one_line(tmp_path, sig, background):
    """SIGUSR1 with checkpoint.async saving every step: the signal lands while a background write is
    in flight; the stop's save waits for it, and the run resumes from the step it stopped at."""
    out = tmp_path / "run"
    job = Job(out, *(["checkpoint.async=true", "checkpoint.every=1"] if background else []))
    job.wait_for_event("step", 2)
    os.kill(job.proc.pid, sig)
    assert job.wait() == EXIT_RESUMABLE, job.text("stderr")[-3000:]
    err = job.text("stderr")
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if sig.name in line and "rank" not in line.split(":")[0]]
    assert len([line for line in said if line.startswith("qwenkit train: ")]) == 1, err[-3000:]
    if not background:
        assert checkpoints(out) == [job.step()]
        return
    steps = checkpoints(out)  # keep_last=2: the stop's checkpoint and the one before, both complete
    assert steps == [job.step() - 1, job.step()] and not list(ckpt.checkpoint_root(out).glob(".tmp-*")), steps
    # what the next start on 2 ranks resumes, every file's checksum as its marker says (a resume from
    # a stop's checkpoint runs in the SIGTERM test)
    cfg = qconfig.load(overrides=[f"train.output_dir={out}"])
    decision = resume.decide(cfg, 2, check=lambda path: ckpt.check_files(path, checksums=True))
    assert decision.path == ckpt.step_dir(ckpt.checkpoint_root(out), steps[-1]) and not decision.skipped


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    job = Job(out)
    job.wait_for_event("step", 2)
    os.kill(rank_pids(job.proc.pid)[1], signal.SIGTERM)  # rank 1 alone: the ranks agree through a collective
    assert job.wait() == EXIT_RESUMABLE, job.text("stderr")[-3000:]
    (step,) = checkpoints(out)
    logs = [(out / "logs" / f"rank-0000{r}.log").read_text() for r in (0, 1)]
    assert f"stopped by a stop signal to another rank after step {step} of {STEPS}" in logs[0]
    assert f"stopped by SIGTERM after step {step} of {STEPS}" in logs[1]


def _pid_namespace_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-p", "-f", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _pid_namespace_works(), reason="needs root and unshare for a PID namespace")
def test_sigterm_to_the_launcher_as_pid_1_of_a_container(tmp_path):
    """PID 1 of a PID namespace gets only the signals it has a handler for (Kubernetes' SIGTERM)."""
    out = tmp_path / "run"
    job = Job(out, prefix=["unshare", "-p", "-f"])
    job.wait_for_event("step", 2)
    pid1 = children(job.proc.pid)[0]  # unshare -> the launcher, PID 1 inside
    assert Path(f"/proc/{pid1}/status").read_text().split("NSpid:")[1].splitlines()[0].split()[-1] == "1"
    os.kill(pid1, signal.SIGTERM)
    assert job.wait() == EXIT_RESUMABLE, job.text("stderr")[-3000:]
    assert checkpoints(out) == [job.step()]


@pytest.mark.slow
def test_a_second_signal_stops_at_once(tmp_path):
    out = tmp_path / "run"
    # steps of 128 rows (seconds each, not the tiny default's 0.1 s): on a fast machine the ranks
    # finished step 1, saved and exited between the two signals (exit 75 instead of 143)
    job = Job(out, "data.tiny_samples=256", "train.micro_batch_size=128")
    # the ranks are up (their handlers installed) and still building: a save is seconds away
    job.wait_for_event("started")
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait_for(r"send it again to stop at once", which="stderr")  # the launcher took the first one
    os.kill(job.proc.pid, signal.SIGTERM)
    code = job.wait()
    err = job.text("stderr")
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM again: stopping at once" in err, err[-3000:]
    # a save under way is never waited for: at most the first signal's checkpoint
    assert len(checkpoints(out)) <= 1 and job.step() <= 1


def test_the_exit_code_a_scheduler_requeues_on():
    assert stopping.EXIT_RESUMABLE == EXIT_RESUMABLE
