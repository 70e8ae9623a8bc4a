"""qwenkit.engine.checkpoints.dcp under faults, on 2 gloo ranks with a small model: two "nodes" with separate folders,
ranks that see different checkpoints, a save killed mid-prune, a full disk (DCP's writer, a real tmpfs), and the
background save's (``checkpoint.async``) full disk, changed weights and killed rank (issues #23, #32)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from jobs import HANG
from multiproc import run_ranks

from qwenkit import config as qconfig
from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.checkpoints import resume
from qwenkit.engine.run import train


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
    rt = train.fsdp.init_distributed(cfg.parallel)
    try:
        resume.agree(cfg, rt.rank, rt.world_size)
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


# ---------------------------------------------------------------------------------------------
# A full disk in the middle of a run (issue 66): the trainer stops in one line naming the folder and the
# bytes; the previous checkpoint stays the newest complete one; resume: auto goes on from it as if nothing
# had happened. With checkpoint.async too (the failure surfaces at the next step, never hidden)

FULL_RUN = ["train.steps=6", "train.micro_batch_size=2", "train.warmup_steps=2", "data.tiny_samples=16",
            "checkpoint.every=2", "checkpoint.keep_last=3", "data.tiny_eval_samples=0", "train.eval_samples=0",
            "train.resume=auto"]  # fmt: skip
FULL_RUNS = [("A", [], False), ("F", [], True), ("F", [], False), ("FA", ["checkpoint.async=true"], True),
             ("FA", ["checkpoint.async=true"], False)]  # (run folder, overrides, rank 1's disk full at step 4's save)


def _full_disk_runs(rank, out):
    import contextlib
    import io

    from torch.distributed.checkpoint import filesystem

    from qwenkit.engine.run import rank as rank_entry

    dist.init_process_group("gloo")
    real_write, real_start = filesystem._write_item, ckpt.start_save
    full = [False, False]  # [this run's step 4 is to fail, the save under way is step 4's]

    def no_space_at_step_4(*a, **k):  # DCP's writer, also in checkpoint.async's background thread
        if full[0] and full[1] and rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*a, **k)

    def start_save(root, step, *a, **k):
        full[1] = step == 4
        return real_start(root, step, *a, **k)

    filesystem._write_item, ckpt.start_save = no_space_at_step_4, start_save
    results = []
    for name, overrides, fails in FULL_RUNS:
        full[0] = fails
        cfg = qconfig.load(overrides=[*FULL_RUN, *overrides, f"train.output_dir={out / name}"])
        trainer = train.Trainer(cfg)
        said, error = "", None
        try:
            trainer.run()
        except ckpt.CheckpointError as e:  # a SaveError: every rank's, one line
            error = f"{type(e).__name__}: {e}"
            console = io.StringIO()
            with contextlib.redirect_stderr(console):
                rank_entry.report_failure(rank, e, out / f"{name}-rank{rank}.log")
            said = console.getvalue()
        results.append({"name": name, "start": trainer.start_step, "losses": [h["loss"] for h in trainer.history],
                        "error": error, "said": said, "complete": [p.name for p in ckpt.complete_checkpoints(out / name / "checkpoints")],
                        "left": sorted(p.name for p in (out / name / "checkpoints").iterdir())})  # fmt: skip
    (out / f"full-{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_full_disk_mid_run_stops_in_one_line_and_resume_goes_on_as_if_uninterrupted(tmp_path):
    assert run_ranks(_full_disk_runs, 2, tmp_path, timeout=HANG) == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"full-{r}.json").read_text()) for r in (0, 1))
    a, *broken = r0
    assert a["error"] is None and len(a["losses"]) == 6
    root = {name: tmp_path / name / "checkpoints" for name in ("F", "FA")}
    for stopped, resumed, other in zip(broken[::2], broken[1::2], r1[1::2]):
        name = stopped["name"]
        # the run stops at step 4's save (async: at the next step, when the background write is found failed)
        assert stopped["error"] == other["error"] and stopped["error"].startswith(
            f"SaveError: checkpoint step 4 not saved: the disk of {str(root[name])!r} (mounted at ")
        needed = int(re.search(r"this save needs about ([\d,]+) bytes \(rank 1\)", stopped["error"]).group(1).replace(",", ""))
        step_2 = json.loads((root[name] / "step-00000002" / ckpt.COMPLETE).read_text())["files"]
        assert needed == sum(size for size, _ in step_2.values())  # the previous checkpoint's bytes: the same state
        assert stopped["error"].endswith(f"'{root[name] / 'step-00000002'}' is intact; make room (or set train.output_dir "
                                         "on a disk with room) and run the same command again: train.resume=auto goes "
                                         "on from step 2")  # fmt: skip
        # one line, rank 0's; nothing half-written left, step 2 the newest complete checkpoint
        log = tmp_path / f"{name}-rank0.log"
        message = stopped["error"].removeprefix("SaveError: ")
        assert stopped["said"] == f"qwenkit train: {message} (rank 0; its traceback: {log})\n" and other["said"] == ""
        assert "Traceback" in log.read_text()
        assert stopped["complete"] == ["step-00000002"] and stopped["left"] == ["step-00000002"], stopped
        # async: found failed at the first step whose check sees every rank's write ended, at the latest the next save's
        assert stopped["losses"] == a["losses"][: len(stopped["losses"])] and len(stopped["losses"]) in ((4,) if name == "F" else (5, 6))
        # resume: auto from step 2 takes the steps the uninterrupted run took, bit for bit
        assert resumed["error"] is None and resumed["start"] == 2 and resumed["losses"] == a["losses"][2:], (resumed, a)
        assert resumed["complete"] == ["step-00000002", "step-00000004", "step-00000006"]


def test_a_file_larger_than_may_be_written_is_named_with_the_limit():
    """EFBIG (``ulimit -f``, a filesystem's largest file): its own line, with the limit and the bytes."""
    from qwenkit.engine.checkpoints import files

    tmp = Path("/runs/x/checkpoints/.tmp-step-00000004")
    failed = [{"rank": 1, "ranks": [1], "enospc": False, "efbig": True, "limit": 1 << 20, "nbytes": 1_291_812,
               "error": "OSError: [Errno 27] File too large"}]  # fmt: skip
    assert files.failure_message(4, tmp, failed, 2_583_624, 10**9) == (
        "checkpoint step 4 not saved: a file of it in '/runs/x/checkpoints' is larger than rank 1 may write (EFBIG: "
        "this process's file-size limit is 1,048,576 bytes (ulimit -f)): this save needs about 2,583,624 bytes, "
        "1,291,812 of them from rank 1")  # fmt: skip
    error = RuntimeError("write failed")
    error.__cause__ = OSError(errno.EFBIG, "File too large")
    assert files.is_efbig(error) and not files.is_enospc(error)


@pytest.mark.slow
def test_a_real_file_size_limit_fails_the_save_in_one_line(tmp_path):
    """``ulimit -f 1024`` (1 MiB) below the tiny model's shards (about 1.3 MB a rank): the write fails with
    EFBIG (CPython ignores SIGXFSZ from its start, so no rank is killed by it) and the save says it, once,
    with the limit; nothing half-written is left."""
    import resource
    import subprocess

    from jobs import HANG, ROOT, checkpoints, train_cmd
    from multiproc import scaled

    out = tmp_path / "run"

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    proc = subprocess.run(train_cmd(out, "checkpoint.every=2", steps=4), cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(HANG), preexec_fn=limited)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("qwenkit train:") and "qwenkit.torchrun" not in line]
    (line,) = ours
    assert line.startswith(f"qwenkit train: checkpoint step 2 not saved: a file of it in {str(out / 'checkpoints')!r} is "
                           "larger than rank 0, 1 may write (EFBIG: this process's file-size limit is 1,048,576 bytes "
                           "(ulimit -f)): this save needs about "), line  # fmt: skip
    assert "raise the file-size limit (ulimit -f)" in line and "it starts afresh" in line
    assert checkpoints(out) == [] and list((out / "checkpoints").iterdir()) == []
