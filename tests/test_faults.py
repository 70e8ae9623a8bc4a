"""What clusters do to a job (issue #23), done to real ``qwenkit train`` processes on 2 gloo ranks.

Signals go to the real launcher, torchrun and rank processes (found through ``/proc``); the
checkpoint faults are done to real checkpoints (a flipped byte, a truncated file, an empty
marker, two "nodes" with separate folders, a full tmpfs). Timeouts catch hangs, not slowness.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from multiproc import free_port, run_ranks

from qwenkit import cli, launch
from qwenkit import config as qconfig
from qwenkit.engine import checkpoint as ckpt
from qwenkit.engine import resume, train

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["data.tiny_samples=16", "data.tiny_eval_samples=0", "train.eval_samples=0", "train.warmup_steps=2"]
HANG = 240  # seconds: a test waiting longer than this has found a hang
STEPS = int(os.environ.get("QK_FAULTS_STEPS", 400))  # long enough to be signalled mid-run
EXIT_RESUMABLE = 75  # qwenkit.engine.EXIT_RESUMABLE, spelled out: a scheduler sees the number


def _cmd(out, *overrides, nproc=2, steps=STEPS):
    return [
        sys.executable, "-m", "qwenkit.cli", "train", "--config", "params/tiny_cpu.yaml", "--nproc", str(nproc),
        "--master-port", str(free_port()), *SMALL, f"train.steps={steps}", "checkpoint.every=0",
        f"train.output_dir={out}", *overrides,
    ]  # fmt: skip


class Job:
    """A ``qwenkit train`` in its own session, its output in files (read while it runs)."""

    def __init__(self, out: Path, *overrides, prefix=(), **kw):
        self.out = out
        self.stdout, self.stderr = Path(f"{out}.stdout"), Path(f"{out}.stderr")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.stdout, "w") as o, open(self.stderr, "w") as e:
            self.proc = subprocess.Popen(
                [*prefix, *_cmd(out, *overrides, **kw)], cwd=ROOT, stdout=o, stderr=e, env=env, start_new_session=True
            )

    def text(self, which="stdout") -> str:
        return (self.stdout if which == "stdout" else self.stderr).read_text()

    def wait_for(self, pattern: str, which="stdout", timeout=HANG) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text(which), flags=re.M)
            if found:
                return found
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode} before {pattern!r}:\n{self.text('stderr')[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.text('stderr')[-3000:]}")

    def wait(self, timeout=HANG) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(self.proc.pid)
            raise

    def step(self) -> int:
        found = re.findall(r"^step (\d+)/", self.text(), flags=re.M)
        return int(found[-1]) if found else 0


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    out = []
    for child in _children(pid):
        out += [child, *_tree(child)]
    return out


def _kill_tree(pid: int) -> None:
    for p in [pid, *_tree(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _rank_pids(launcher: int, timeout=HANG) -> dict[int, int]:
    """rank -> pid of the ranks under ``launcher`` (launcher -> torchrun -> ranks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = {}
        for pid in _tree(launcher):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"qwenkit.engine.train" in cmdline:
                rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
                if rank is not None:
                    ranks[rank] = pid
        if len(ranks) == 2:
            return ranks
        time.sleep(0.2)
    raise AssertionError(f"ranks of {launcher} not found")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone(pids, timeout=HANG) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def _checkpoints(out: Path) -> list[int]:
    return [ckpt.step_of(p) for p in ckpt.complete_checkpoints(ckpt.checkpoint_root(out))]


# ---------------------------------------------------------------------------------------------
# Items 1, 2, 5: signals to the launcher; one folder, one job


@pytest.mark.slow
def test_sigterm_saves_and_exits_resumable_and_a_second_job_in_the_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    job = Job(out)
    job.wait_for(r"^step 2/", timeout=HANG)
    ranks = _rank_pids(job.proc.pid)
    torchrun = _children(job.proc.pid)
    # a second job into the same folder, another seed: refused, naming the first; nothing written
    second = subprocess.run(_cmd(out, "train.seed=7"), cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert second.returncode == 2, second.stderr
    assert "is in use by another qwenkit train" in second.stderr and f"pid {job.proc.pid}" in second.stderr
    assert "torchrun" not in second.stdout
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == 42
    assert len(second.stderr.strip().splitlines()) == 1

    os.kill(job.proc.pid, signal.SIGTERM)
    code = job.wait()
    assert code == EXIT_RESUMABLE, job.text("stderr")[-3000:]
    steps = _checkpoints(out)
    assert len(steps) == 1 and steps[0] >= 2 and steps[0] == job.step()  # the step it was in, finished
    for rank in (0, 1):
        log = (out / "logs" / f"rank-0000{rank}.log").read_text()
        assert f"stopped by SIGTERM after step {steps[0]} of {STEPS}" in log, log[-2000:]
    assert _gone([*ranks.values(), *torchrun], timeout=30)
    assert "Traceback" not in job.text("stderr")
    assert not list(out.glob(".config-*.yaml"))  # the ranks' own copy of the config is gone with them
    # the lock went with the job: the folder takes a new one (which resumes where it stopped)
    again = subprocess.run(_cmd(out, f"train.steps={steps[0] + 1}"), cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt.step_dir(ckpt.checkpoint_root(out), steps[0])} at step {steps[0]}" in again.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig, background", [(signal.SIGINT, False), (signal.SIGUSR1, True)])
def test_sigint_and_sigusr1_save_with_one_line(tmp_path, sig, background):
    """SIGUSR1 with checkpoint.async saving every step: the signal lands while a background write is
    in flight; the stop's save waits for it, and the run resumes from the step it stopped at."""
    out = tmp_path / "run"
    job = Job(out, *(["checkpoint.async=true", "checkpoint.every=1"] if background else []))
    job.wait_for(r"^step 2/")
    os.kill(job.proc.pid, sig)
    assert job.wait() == EXIT_RESUMABLE, job.text("stderr")[-3000:]
    err = job.text("stderr")
    assert "KeyboardInterrupt" not in err and "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if sig.name in line and "rank" not in line.split(":")[0]]
    assert len([line for line in said if line.startswith("qwenkit train: ")]) == 1, err[-3000:]
    if not background:
        assert _checkpoints(out) == [job.step()]
        return
    steps = _checkpoints(out)  # keep_last=2: the stop's checkpoint and the one before, both complete
    assert steps == [job.step() - 1, job.step()] and not list(ckpt.checkpoint_root(out).glob(".tmp-*")), steps
    again = subprocess.run(_cmd(out, f"train.steps={steps[-1] + 1}"), cwd=ROOT, capture_output=True, text=True, timeout=HANG)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt.step_dir(ckpt.checkpoint_root(out), steps[-1])} at step {steps[-1]}" in again.stderr


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    out = tmp_path / "run"
    job = Job(out)
    job.wait_for(r"^step 2/")
    os.kill(_rank_pids(job.proc.pid)[1], signal.SIGTERM)  # rank 1 alone: the ranks agree through a collective
    assert job.wait() == EXIT_RESUMABLE, job.text("stderr")[-3000:]
    (step,) = _checkpoints(out)
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
    job.wait_for(r"^step 2/")
    pid1 = _children(job.proc.pid)[0]  # unshare -> the launcher, PID 1 inside
    assert Path(f"/proc/{pid1}/status").read_text().split("NSpid:")[1].splitlines()[0].split()[-1] == "1"
    os.kill(pid1, signal.SIGTERM)
    assert job.wait() == EXIT_RESUMABLE, job.text("stderr")[-3000:]
    assert _checkpoints(out) == [job.step()]


@pytest.mark.slow
def test_a_second_signal_stops_at_once(tmp_path):
    out = tmp_path / "run"
    job = Job(out)
    # the ranks are up (their handlers installed) and still building: a save is seconds away
    job.wait_for(r"rank 0 of 2 on cpu", which="stderr")
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait_for(r"send it again to stop at once", which="stderr")  # the launcher took the first one
    os.kill(job.proc.pid, signal.SIGTERM)
    code = job.wait()
    err = job.text("stderr")
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "SIGTERM again: stopping at once" in err, err[-3000:]
    # on a quiet machine the ranks may have finished their step and its save in the moments between
    # the two signals; a save under way is never waited for: at most the first signal's checkpoint
    assert len(_checkpoints(out)) <= 1 and job.step() <= 1


@pytest.mark.slow
def test_a_killed_launcher_group_takes_torchrun_and_the_ranks_with_it(tmp_path):
    out = tmp_path / "run"
    job = Job(out)
    job.wait_for(r"^step 2/")
    ranks = _rank_pids(job.proc.pid)
    torchrun = _children(job.proc.pid)
    os.killpg(job.proc.pid, signal.SIGKILL)  # the launcher's whole process group
    job.wait()
    assert _gone([*torchrun, *ranks.values()], timeout=120), "torchrun or ranks still running without the launcher"
    # torchrun got SIGTERM when the launcher died, so the ranks saved on their way out
    assert len(_checkpoints(out)) == 1 and 2 <= _checkpoints(out)[0] < STEPS  # not orphans that trained on


@pytest.mark.slow
def test_a_killed_torchrun_takes_the_ranks_with_it(tmp_path):
    out = tmp_path / "run"
    job = Job(out)
    job.wait_for(r"^step 2/")
    ranks = _rank_pids(job.proc.pid)
    (torchrun,) = _children(job.proc.pid)
    os.kill(torchrun, signal.SIGKILL)
    assert job.wait() == 128 + signal.SIGKILL
    assert _gone(ranks.values(), timeout=60), "ranks still training after torchrun died"
    assert _checkpoints(out) == []  # they died with it: no orphan trained on to a final save


# ---------------------------------------------------------------------------------------------
# Items 3, 4: a killed rank, a hung rank


@pytest.mark.slow
def test_the_rank_killed_first_is_named_with_its_signal_and_code(tmp_path):
    out = tmp_path / "run"
    job = Job(out)
    job.wait_for(r"^step 2/")
    ranks = _rank_pids(job.proc.pid)
    os.kill(ranks[1], signal.SIGKILL)
    code = job.wait()
    err = job.text("stderr")
    assert code == 128 + signal.SIGKILL, err[-3000:]
    named = re.findall(r"^qwenkit train: rank (\d) \(pid (\d+)\) failed first: killed by (SIG\w+)", err, flags=re.M)
    assert named == [("1", str(ranks[1]), "SIGKILL")], err[-3000:]
    assert "the rank that failed first is named above" in err.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_hung_rank_times_out_and_is_named(tmp_path):
    out = tmp_path / "run"
    job = Job(out, "parallel.timeout_s=8")
    job.wait_for(r"^step 2/")
    ranks = _rank_pids(job.proc.pid)
    began = time.monotonic()
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        found = job.wait_for(r"qwenkit train: rank 0 failed: .*stopped answering: rank 1 \(silent for (\d+) s", which="stderr")
    finally:
        try:
            os.kill(ranks[1], signal.SIGCONT)
        except ProcessLookupError:
            pass
    waited = time.monotonic() - began
    assert int(found.group(1)) >= 4 and waited < 8 + 120  # parallel.timeout_s, not gloo's 30 minutes
    assert job.wait() != 0


def test_timeout_key_is_validated_before_spawning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("must not start"))
    assert cli.main(["train", "parallel.timeout_s=0", f"train.output_dir={tmp_path / 'run'}"]) == 2
    assert "parallel.timeout_s must be >= 1" in capsys.readouterr().err
    assert qconfig.load().parallel.timeout_s == 600


def test_the_exit_code_a_scheduler_requeues_on():
    from qwenkit.engine import stopping

    assert stopping.EXIT_RESUMABLE == EXIT_RESUMABLE


# ---------------------------------------------------------------------------------------------
# Items 6, 8, 11: stop_after's loop to the end; damaged checkpoints; another data order (issue 34)


@pytest.mark.slow
def test_stop_after_loop_damage_and_world_size(tmp_path):
    out = tmp_path / "run"

    def run(*overrides, nproc=2):
        cmd = _cmd(out, "train.stop_after=2", "checkpoint.keep_last=3", *overrides, nproc=nproc, steps=4)
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG)

    first = run()
    assert first.returncode == EXIT_RESUMABLE, first.stderr[-3000:]
    assert "run the same command again to continue" in first.stderr and _checkpoints(out) == [2]
    second = run()
    assert second.returncode == 0, second.stderr[-3000:]
    assert re.findall(r"^step (\d)/4", second.stdout, flags=re.M) == ["3", "4"] and _checkpoints(out) == [2, 4]
    third = run()
    assert third.returncode == 0 and "training is complete: at step 4 of train.steps=4" in third.stderr
    assert not re.search(r"^step \d/", third.stdout, flags=re.M)

    # another data order (train.seed): refused by the launcher from COMPLETE.json in one line,
    # nothing started, the run's record (config.yaml) left as the run wrote it
    record = (out / "config.yaml").read_text()
    other = run("train.seed=2")
    assert other.returncode == 2, other.stderr[-3000:]
    refusal = [line for line in other.stderr.splitlines() if "cannot resume" in line]
    assert len(refusal) == 1 and "train.seed saved 42, now 2: set train.seed=42 to continue" in refusal[0], other.stderr
    assert "torchrun" not in other.stdout and "Traceback" not in other.stderr
    assert (out / "config.yaml").read_text() == record

    root = ckpt.checkpoint_root(out)
    # a truncated file, asked for by path: one line naming checkpoint and file, offering step 2
    truncated = root / "step-00000004" / "__1_0.distcp"
    saved = truncated.read_bytes()
    truncated.write_bytes(saved[: len(saved) // 2])
    named = run(f"train.resume={root / 'step-00000004'}", "train.steps=6", "train.stop_after=0")
    assert named.returncode == 2, named.stderr[-3000:]
    assert "__1_0.distcp is" in named.stderr and str(root / "step-00000004") in named.stderr
    assert f"the newest older complete checkpoint is {str(root / 'step-00000002')!r}" in named.stderr
    assert "PytorchStreamReader" not in named.stderr and "Traceback" not in named.stderr
    truncated.write_bytes(saved)

    # 64 flipped bytes inside a .distcp (same size: only the checksum sees it): auto falls back
    flipped = root / "step-00000004" / "__0_0.distcp"
    data = bytearray(flipped.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    flipped.write_bytes(bytes(data))
    fallback = run("train.steps=6", "train.stop_after=0")
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert "__0_0.distcp fails its checksum" in fallback.stderr and "falling back" in fallback.stderr
    assert f"resumed from {root / 'step-00000002'} at step 2" in fallback.stderr
    assert re.findall(r"^step (\d)/6", fallback.stdout, flags=re.M) == ["3", "4", "5", "6"]
    assert _checkpoints(out) == [2, 6] and list(root.glob("damaged-step-00000004-*"))


def test_damaged_markers_are_named_and_auto_skips_them(tmp_path):
    root = ckpt.checkpoint_root(tmp_path)
    for step, marker in [(2, {"step": 2}), (4, ""), (6, "{not json")]:
        ckpt.step_dir(root, step).mkdir(parents=True)
        text = marker if isinstance(marker, str) else json.dumps(marker)
        (ckpt.step_dir(root, step) / ckpt.COMPLETE).write_text(text)
    decision = resume.decide(qconfig.load(overrides=[f"train.output_dir={tmp_path}"]), None)
    assert decision.path == ckpt.step_dir(root, 2)
    assert [(p.name, re.sub(r".*COMPLETE.json is ", "", why)[:5]) for p, why in decision.skipped] == [
        ("step-00000006", "not v"), ("step-00000004", "empty")
    ]
    with pytest.raises(ckpt.CheckpointError, match=r"COMPLETE.json is empty; the newest older complete checkpoint is .*step-00000002"):
        resume.decide(qconfig.load(overrides=[f"train.output_dir={tmp_path}", f"train.resume={ckpt.step_dir(root, 4)}"]), None)


def test_launcher_writes_fail_in_one_line(tmp_path, monkeypatch, capsys):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "config.yaml"))

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("must not start"))
    monkeypatch.setattr(qconfig, "write_config", full)
    assert cli.main(["train", f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("qwenkit")]
    assert err == [f"qwenkit train: cannot write {tmp_path / 'run' / 'config.yaml'}: No space left on device "
                   f"({tmp_path / 'run' / 'config.yaml'})"]  # fmt: skip


def test_the_lock_is_held_and_taken_over_when_its_holder_is_gone(tmp_path):
    fd = launch.acquire_lock(tmp_path)
    with pytest.raises(launch.OutputDirBusy, match=f"pid {os.getpid()} on "):
        launch.acquire_lock(tmp_path)
    os.close(fd)  # the holder exits: the kernel drops the flock; the file with its pid stays
    assert json.loads(launch.lock_path(tmp_path).read_text())["pid"] == os.getpid()
    os.close(launch.acquire_lock(tmp_path))
    # a stale file naming a dead process: taken over
    launch.lock_path(tmp_path).write_text(json.dumps({"pid": 999999999, "host": "elsewhere"}))
    os.close(launch.acquire_lock(tmp_path))


# ---------------------------------------------------------------------------------------------
# Items 7, 9, 10: on 2 gloo ranks, with a small model


class _Sampler:
    def state_dict(self):
        return {"epoch": 0, "index": 3}

    def load_state_dict(self, state):
        assert state == self.state_dict()


def _small_model():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


class _Killed(BaseException):
    pass


def _checkpoint_faults(rank, out, tmpfs):
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    model, optimizer = _small_model()
    results = {}

    # item 7: two "nodes", each its own folder: no COMPLETE.json anywhere, one error on each
    node = out / f"node{rank}"
    try:
        ckpt.save(node / "checkpoints", 1, model, optimizer, _Sampler(), cpu, keep_last=2)
        results["nodes"] = "saved"
    except ckpt.CheckpointError as e:
        results["nodes"] = str(e)
    # ... and ranks that see different checkpoints are refused before they load any
    shared = out / "shared"
    ckpt.save(shared / "checkpoints", 1, model, optimizer, _Sampler(), cpu, keep_last=2)
    view = out / f"view{rank}"
    if rank == 1:
        shutil.copytree(shared / "checkpoints", view / "checkpoints")
    else:
        view.mkdir()
    dist.barrier()
    cfg = qconfig.load(overrides=[f"train.output_dir={view}", "parallel.device=cpu"])
    trainer = train.Trainer(cfg)
    trainer.rt = train.fsdp.init_distributed(cfg.parallel)
    try:
        trainer.resume_point()
        results["views"] = "agreed"
    except ckpt.CheckpointError as e:
        results["views"] = str(e)

    # item 9: killed while pruning step 1 (keep_last=1, saving step 2): step 1 never looks complete
    real_rmtree = shutil.rmtree

    def dying_rmtree(path, *a, **k):
        path = Path(path)
        if rank == 0 and "00000001" in path.name:
            (path / ".metadata").unlink()
            raise _Killed
        return real_rmtree(path, *a, **k)

    ckpt.shutil.rmtree = dying_rmtree
    try:
        ckpt.save(shared / "checkpoints", 2, model, optimizer, _Sampler(), cpu, keep_last=1)
    except _Killed:
        dist.barrier()  # the barrier the killed save's rank 0 never reached
    ckpt.shutil.rmtree = real_rmtree
    dist.barrier()
    results["after_prune"] = [(p.name, ckpt.check_files(p)) for p in ckpt.complete_checkpoints(shared / "checkpoints")]

    # item 10: a full disk (DCP's writer on rank 1 gets ENOSPC)
    from torch.distributed.checkpoint import filesystem

    real_write = filesystem._write_item

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    filesystem._write_item = no_space if rank == 1 else real_write
    try:
        ckpt.save(shared / "checkpoints", 3, model, optimizer, _Sampler(), cpu, keep_last=2)
        results["enospc"] = "saved"
    except ckpt.CheckpointError as e:
        results["enospc"] = str(e)
    filesystem._write_item = real_write
    results["left"] = sorted(p.name for p in (shared / "checkpoints").iterdir())
    # ... and a real one, when the test may mount a small tmpfs. Where the disk fills decides
    # what the write raises: an OSError(ENOSPC) from a plain write, or torch.save's zip writer's
    # RuntimeError ("unexpected pos"), which has no errno. Both must read as a full disk.
    if tmpfs:
        results["tmpfs"], results["tmpfs_left"] = [], []
        for kib in (0, 6, 12, 18, 24, 36, 48):
            if rank == 0:
                try:
                    (Path(tmpfs) / "filler").write_bytes(b"x" * (kib << 10))
                except OSError:
                    pass
            dist.barrier()
            try:
                ckpt.save(Path(tmpfs) / "checkpoints", 1, model, optimizer, _Sampler(), cpu, keep_last=2)
                results["tmpfs"].append("saved")
            except ckpt.CheckpointError as e:
                results["tmpfs"].append(str(e))
            results["tmpfs_left"] += sorted(p.name for p in (Path(tmpfs) / "checkpoints").iterdir())
            dist.barrier()
    (out / f"results-{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture
def small_tmpfs(tmp_path):
    where = tmp_path / "tmpfs"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)]).returncode:
        yield None
        return
    yield where
    subprocess.run(["umount", str(where)])


@pytest.mark.slow
def test_checkpoint_faults_on_two_ranks(tmp_path, small_tmpfs):
    codes = run_ranks(_checkpoint_faults, 2, tmp_path, str(small_tmpfs) if small_tmpfs else None)
    assert codes == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"results-{r}.json").read_text()) for r in (0, 1))
    # 7: no rank marks a checkpoint that is not whole in its folder; the same error on both
    assert r0["nodes"] == r1["nodes"] and "does not see rank" in r0["nodes"], r0["nodes"]
    assert "train.output_dir (a filesystem shared by every node)" in r0["nodes"]
    assert not list(tmp_path.glob("node*/checkpoints/*/COMPLETE.json"))
    assert not list(tmp_path.glob("node*/checkpoints/.tmp-*"))
    for r in (r0, r1):
        assert "do not see the same checkpoints" in r["views"] and "rank 1 sees ['step-00000001']" in r["views"], r["views"]
    # 9: killed mid-prune: the half-deleted step 1 is not complete; step 2 is, and whole
    assert r0["after_prune"] == [["step-00000002", None]], r0["after_prune"]
    # 10: one line naming the disk and the bytes, the same on every rank; the partial save gone
    assert r0["enospc"] == r1["enospc"]
    assert re.search(r"checkpoint step 3 not saved: the disk of .* \(mounted at .*\) is full: [\d,]+ bytes free, "
                     r"this save needs about [\d,]+ bytes \(rank 1\); the partial save was removed; .*step-00000002' is intact",
                     r0["enospc"]), r0["enospc"]  # fmt: skip
    assert not any(name.startswith(".tmp") for name in r0["left"]) and "step-00000003" not in r0["left"]
    if small_tmpfs:
        assert r0["tmpfs"] == r1["tmpfs"]
        for message in r0["tmpfs"]:
            assert f"(mounted at {small_tmpfs}) is full" in message, message
        assert r0["tmpfs_left"] == []


def test_checksum_cost_next_to_the_write(tmp_path):
    """CRC-32 over what a save wrote reads it back from the page cache: far cheaper than writing."""
    blob = os.urandom(64 << 20)
    began = time.perf_counter()
    with open(tmp_path / "x", "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - began
    began = time.perf_counter()
    ckpt.crc32_file(tmp_path / "x")
    crc_s = time.perf_counter() - began
    print(f"64 MiB: write+fsync {write_s:.3f} s, crc32 {crc_s:.3f} s")
    assert crc_s < 10 * max(write_s, 0.05)  # catches a pathological checksum, not a slow machine


# ---------------------------------------------------------------------------------------------
# checkpoint.async (issue 32): the background write's faults, on 2 gloo ranks with a small model


def _async_faults(rank, out):
    from torch.distributed.checkpoint import filesystem

    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    model, optimizer = _small_model()
    root, group, results = out / "checkpoints", ckpt.AsyncSaves(cpu), {}
    ckpt.finish(ckpt.start_save(root, 1, model, optimizer, _Sampler(), cpu, keep_last=3, saves=group))
    # the state is staged when start_save returns: the weights may change under the write
    saved = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    pending = ckpt.start_save(root, 2, model, optimizer, _Sampler(), cpu, keep_last=3, saves=group)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ckpt.finish(pending)
    fresh, fresh_optimizer = _small_model()
    ckpt.load(root / "step-00000002", fresh, fresh_optimizer, _Sampler(), cpu)
    results["staged"] = all(torch.equal(fresh.state_dict()[k].full_tensor(), v) for k, v in saved.items())
    real_write = filesystem._write_item

    def no_space(*a, **k):  # a full disk, met by rank 1's background writer
        raise OSError(errno.ENOSPC, "No space left on device")

    filesystem._write_item = no_space if rank == 1 else real_write
    pending = ckpt.start_save(root, 3, model, optimizer, _Sampler(), cpu, keep_last=3, saves=group)
    try:
        ckpt.finish(pending)
        results["enospc"] = "saved"
    except ckpt.CheckpointError as e:
        results["enospc"] = str(e)
    results["after_enospc"] = sorted(p.name for p in root.iterdir())
    (out / f"results-{rank}.json").write_text(json.dumps(results))

    def killed(*a, **k):  # rank 1 is SIGKILLed in the middle of its background write
        os.kill(os.getpid(), signal.SIGKILL)

    filesystem._write_item = killed if rank == 1 else real_write
    ckpt.finish(ckpt.start_save(root, 4, model, optimizer, _Sampler(), cpu, keep_last=1, saves=group))
    (out / f"finished-{rank}").write_text("step 4 looked complete")


@pytest.mark.slow
def test_async_save_faults_leave_the_previous_checkpoint_the_one_resumed(tmp_path):
    codes = run_ranks(_async_faults, 2, tmp_path, timeout=HANG)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, codes
    r0, r1 = (json.loads((tmp_path / f"results-{r}.json").read_text()) for r in (0, 1))
    assert r0["staged"] and r1["staged"]  # the weights changed after start_save; the checkpoint did not
    assert r0["enospc"] == r1["enospc"] and "is full" in r0["enospc"] and "step-00000002' is intact" in r0["enospc"]
    assert r0["after_enospc"] == ["step-00000001", "step-00000002"]  # no partial step 3 left
    # killed mid-write: step 4 never looks complete, keep_last=1 pruned nothing, step 2 is resumed
    assert not list(tmp_path.glob("finished-*"))
    root = tmp_path / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000001", "step-00000002"]
    assert (root / ".tmp-step-00000004").is_dir()
    cfg = qconfig.load(overrides=[f"train.output_dir={tmp_path}"])
    assert resume.decide(cfg, None).path == root / "step-00000002"
