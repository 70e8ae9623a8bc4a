"""Training checkpoints: the collective DCP save and load, and the RNG state (the HF export: :mod:`qwenkit.engine.checkpoints.export`).

A checkpoint is a directory ``<output_dir>/checkpoints/step-00000012/`` holding

- the DCP files of ``{"model": ..., "optimizer": ...}`` from ``get_state_dict`` (each rank writes
  its own shards; a load reshards them to whatever the loading job's sharding is);
- ``train_state.pt``: the step (the same on every rank, written by rank 0);
- ``rank-00000.pt`` ...: per rank, the data position (``sampler.state_dict()``), the RNG
  states of python, numpy, torch CPU and the accelerator, and the objective's state
  (:meth:`qwenkit.engine.objective.Objective.state_dict`: GRPO's cached rollout);
- ``manifest-rank-00000.json`` ...: per rank, the size and CRC-32 of every file that rank wrote;
- ``COMPLETE.json``, written last: step, world size, the run's shape and data-order settings
  (``run``), and every file's size and CRC-32.

Saving is atomic: everything is written under ``.tmp-step-00000012``; then every rank checks that
it sees every rank's files, as the manifests list them (:mod:`qwenkit.engine.checkpoints.files`;
ranks on nodes without one shared output_dir do not, and the save is refused, naming them); only then does rank 0 write
``COMPLETE.json`` and rename the directory. A save killed midway leaves a ``.tmp-*`` directory
that is never picked as latest (and is removed by the next save), so the previous checkpoint
stays the one a resume selects. A save that fails (DCP's ``CheckpointException``; a full disk is
known by errno or by the room left after the failed write, a file-size limit by EFBIG or by
``ulimit -f``) removes its partial directory and raises one :class:`SaveError` (a
:class:`CheckpointError`) on every rank naming the folder, the disk, the bytes free and about the
bytes needed (the tensors of every rank's state dict), and what to do.

``checkpoint.async``: :func:`start_save` has the state copied to CPU memory in a thread, which the
next step's forward and backward overlap (the trainer waits for the copy, :meth:`Save.wait_staged`,
before the optimizer step changes the state), and DCP writes it from a
thread on a gloo group of its own (:class:`AsyncSaves`) while training goes on; :func:`finish`
(called when :func:`written_everywhere` says every rank's write ended, before the next save, and
before a stop) checks and marks it exactly as a synchronous save does: ``COMPLETE.json`` and the
CRC-32s only once every rank's write has finished, pruning only then. One save is in flight at
a time; a crash during the background write leaves a ``.tmp-*`` directory, never a complete one.

Integrity (:mod:`qwenkit.engine.checkpoints.folder`): a resume checks every file against
``COMPLETE.json`` (sizes in the launcher, before any process starts; CRC-32s in the ranks, each
rank reading its share of the files). Which checkpoint a start resumes, and whether it may, is
decided in one place, :func:`qwenkit.engine.checkpoints.resume.decide`: damaged checkpoints, ``resume:
auto``'s fall-back, and never writing over newer checkpoints.

No checkpoint is lost by surprise: a save never replaces a complete checkpoint, and pruning
(``checkpoint.keep_last``) removes only checkpoints *older* than the one just written, never it
and never a newer one (:func:`~qwenkit.engine.checkpoints.folder.prune`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from qwenkit.engine.checkpoints.background import AsyncSaves, then_manifest
from qwenkit.engine.checkpoints.files import (
    SaveError,
    failure_message,
    file_size_limit,
    gather_manifests,
    is_efbig,
    is_enospc,
    one_line,
    write_manifest,
    write_text,
)
from qwenkit.engine.checkpoints.folder import (  # noqa: F401 - the folder's names, for callers of this module too
    COMPLETE,
    MANIFEST,
    PRUNE_PREFIX,
    TMP_PREFIX,
    CheckpointError,
    check_files,
    checkpoint_bytes,
    checkpoint_root,
    complete_checkpoints,
    crc32_file,
    fsync_dir,
    latest,
    prunable,
    prune,
    read_marker,
    resolve,
    run_config_path,
    set_aside,
    set_aside_damaged,
    step_dir,
    step_of,
)
from qwenkit.engine.checkpoints.rng import rng_state, set_rng_state  # noqa: F401 - callers' names too
from qwenkit.engine.objective import Objective
from qwenkit.model.lora import has_adapters

STATELESS = Objective()  # a caller's default: an objective with no state of its own (SFT's, DPO's)


# ---------------------------------------------------------------------------------------------
# Save


@dataclass
class Save:
    """A save under way: started by :func:`start_save`, made complete by :func:`finish` (both collective)."""

    root: Path
    step: int
    keep_last: int
    run: dict | None
    report: dict  # this rank's: bytes, and the error that stopped its part (None: none yet)
    future: Future | None = None  # the background write of checkpoint.async (None: written already)
    staged: Future | None = None  # its copy of the state to CPU memory (None: copied already)

    def wait_staged(self) -> None:
        """Block until the state is copied to CPU memory: called before the next optimizer step,
        which changes the weights and moments the copy reads (forward and backward only read
        them, so they run during the copy). A failed copy fails the write: :func:`finish` reports it."""
        if self.staged is not None:
            self.staged.exception()
            self.staged = None

    @property
    def tmp(self) -> Path:
        return self.root / f"{TMP_PREFIX}{self.step:08d}"

    @property
    def final(self) -> Path:
        return step_dir(self.root, self.step)


def save(root: str | Path, step: int, model, optimizer, sampler, device: torch.device, keep_last: int,
         run: dict | None = None, objective: Objective = STATELESS) -> Path:  # fmt: skip
    """Collective: every rank calls it; the synchronous save. Returns the final directory.

    ``run`` (:func:`qwenkit.engine.checkpoints.resume.run_record`) goes into ``COMPLETE.json``: what the
    launcher checks a resume against before any process starts.

    Raises :class:`CheckpointError` on every rank, before writing anything, when a complete
    checkpoint of that step exists already (the trainer refuses the runs that would get here);
    after writing, when a rank failed to write (the partial directory is removed) or when a rank
    does not see every rank's files (no shared output_dir).
    """
    return finish(start_save(root, step, model, optimizer, sampler, device, keep_last, run, objective=objective))


def start_save(root: str | Path, step: int, model, optimizer, sampler, device: torch.device, keep_last: int,
               run: dict | None = None, saves: AsyncSaves | None = None, objective: Objective = STATELESS) -> Save:  # fmt: skip
    """Collective: write step ``step`` under ``.tmp-step-*``; :func:`finish` makes it a checkpoint.

    Without ``saves`` everything is written here. With ``saves`` (:class:`AsyncSaves`) DCP's
    ``async_save`` copies the model and optimizer state to CPU memory in a thread and writes it
    from another, coordinating on its own gloo group (never on training's); this returns at once,
    and the caller must :meth:`Save.wait_staged` before it changes the state (the next optimizer
    step; torchtitan's ``maybe_wait_for_staging``). The data position, RNG and ``objective``'s
    state (:meth:`~qwenkit.engine.objective.Objective.state_dict`) are written here either way, as
    they are at this step.
    """
    root, rank = Path(root), dist.get_rank()
    pending = Save(root, step, keep_last, run, {"rank": rank, "error": None, "enospc": False, "efbig": False,
                                                "limit": None, "nbytes": 0, "ranks": []})  # fmt: skip
    if (pending.final / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {str(pending.final)!r} exists already; a save never replaces one")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in [*root.glob(f"{TMP_PREFIX}*"), *root.glob(f"{PRUNE_PREFIX}*")]:  # left by a killed save
            shutil.rmtree(stale, ignore_errors=True)
        pending.tmp.mkdir()
    dist.barrier()
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
        pending.report["nbytes"] = _nbytes(model_sd) + _nbytes(optim_sd)
        state = {"model": model_sd, "optimizer": optim_sd}
        # DCP first, on every rank: a rank that failed before it would leave the others in its collectives
        if saves is None:
            dcp.save(state, checkpoint_id=str(pending.tmp))
        else:
            written = dcp.async_save(state, checkpoint_id=str(pending.tmp), process_group=saves.group,
                                     async_stager=saves.stager)  # fmt: skip
        own = {"rng": rng_state(device), "sampler": sampler.state_dict(), "objective": objective.state_dict()}
        _write(pending.tmp / f"rank-{rank:05d}.pt", own)
        if rank == 0:
            _write(pending.tmp / "train_state.pt", {"step": step})
        if saves is not None:  # the manifest lists the rank files: its thread starts after they are written
            # torch >= 2.9 with a staging thread: an AsyncSaveResponse (the copy, then the write); else the write
            pending.staged = getattr(written, "staging_completion", None)
            pending.future = then_manifest(getattr(written, "upload_completion", written), pending.tmp, rank)
    except (Exception, dcp.CheckpointException) as e:  # DCP's exception is a BaseException
        _failed(pending, e)
    return pending


def written_everywhere(pending: Save, device: torch.device) -> bool:
    """Collective: True on every rank when every rank's background write has ended (one all-reduce)."""
    local = 1 if pending.future is None or pending.future.done() else 0
    flag = torch.tensor([local], device=device if dist.get_backend() != "gloo" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def finish(pending: Save) -> Path:
    """Collective: wait for this rank's write; once every rank's files are written and seen by
    every rank, rank 0 writes ``COMPLETE.json``, renames the directory and prunes. Returns it.

    A rank that failed (also in the background) raises one :class:`CheckpointError` on every
    rank, and the partial directory is removed: nothing that looks complete is left.
    """
    rank, world, tmp, report = dist.get_rank(), dist.get_world_size(), pending.tmp, pending.report
    if report["error"] is None:
        try:
            if pending.future is not None:
                pending.future.result()  # the background write and this rank's manifest
            else:
                write_manifest(tmp, rank)
        except (Exception, dcp.CheckpointException) as e:  # DCP's exception is a BaseException
            _failed(pending, e)
    reports = [None] * world
    dist.all_gather_object(reports, report)  # every rank's files are on disk, or its error
    failed = [r for r in reports if r["error"]]
    files, problem = {}, None
    if not failed:  # every rank checks that it sees what every rank wrote
        files, problem = gather_manifests(tmp, world, rank)
    problems = [None] * world
    dist.all_gather_object(problems, problem)
    problems = [p for p in problems if p]
    root, step = pending.root, pending.step
    if failed or problems:
        shutil.rmtree(tmp, ignore_errors=True)  # the partial save, on every rank's filesystem
        previous = latest(root)
        kept = f"{str(previous)!r} is intact" if previous else "there is no earlier checkpoint"
        if failed:
            # the bytes it needs: its tensors, or the previous checkpoint's files (the same state, DCP's overhead in)
            needed = max(sum(r["nbytes"] for r in reports), checkpoint_bytes(previous) if previous else 0)
            message = failure_message(step, tmp, failed, needed, min(r["free"] for r in failed))
        else:
            message = (f"checkpoint step {step} not saved: {problems[0]}: every rank must write to the same "
                       "train.output_dir (a filesystem shared by every node)")  # fmt: skip
        message += f"; the partial save was removed; {kept}"
        if any(r["enospc"] or r["efbig"] for r in failed):  # what to do, then the same command
            room = ("make room (or set train.output_dir on a disk with room)" if any(r["enospc"] for r in failed) else
                    "raise the file-size limit (ulimit -f) or set train.output_dir on a filesystem that holds such files")  # fmt: skip
            again = f"train.resume=auto goes on from step {step_of(previous)}" if previous else "it starts afresh"
            message += f"; {room} and run the same command again: {again}"
        dist.barrier()
        raise SaveError(message)  # its one line is the rank's report (qwenkit.engine.run.rank), not a log line too
    final = pending.final
    if rank == 0:
        marker = {
            "step": step, "world_size": world, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "checksum": "crc32", "files": files, **({"run": pending.run} if pending.run is not None else {}),
        }  # fmt: skip
        write_text(tmp / COMPLETE, json.dumps(marker))
        if final.exists():  # an incomplete leftover (no COMPLETE.json), never a finished checkpoint
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
        for old in prunable(root, final, pending.keep_last):
            prune(old)
    dist.barrier()
    return final


def _failed(pending: Save, error: BaseException) -> None:
    """Note on this rank's report why its part of the save failed (a full disk told apart)."""
    failures = getattr(error, "failures", None)  # DCP names the ranks whose writes failed
    free = shutil.disk_usage(pending.root).free if pending.root.exists() else 0  # the partial save still in place
    # torch.save's zip writer reports a full disk as a RuntimeError without errno ("unexpected
    # pos"): a failed write that left less room than this rank's part needs is a full disk too
    # a file-size limit (ulimit -f) below this rank's part is EFBIG too, however the writer said it
    limit = file_size_limit()
    big = is_efbig(error) or (limit is not None and limit < pending.report["nbytes"])
    full = is_enospc(error) or (not big and free < pending.report["nbytes"])
    pending.report.update(error=one_line(error), enospc=full, efbig=big, limit=limit, free=free,
                          ranks=sorted(failures) if isinstance(failures, dict) else [pending.report["rank"]])  # fmt: skip


def _nbytes(state) -> int:
    """Bytes of the tensors in a (nested) state dict, this rank's shards only."""
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _write(path: Path, obj) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Load


def load(path: str | Path, model, optimizer, sampler, device: torch.device,
         load_optimizer: bool = True, load_rng: bool = True, objective: Objective = STATELESS) -> int:
    """Collective: restore a checkpoint into the (sharded) model and the rest; returns its step.

    The LR schedule is not restored: it is a function of the step and the run's config, which
    the trainer applies after the load (see ``qwenkit.engine.run.optim.build_scheduler``). A
    checkpoint saved by another number of ranks (the resume rule allowed it,
    :func:`qwenkit.engine.checkpoints.resume.fit`) is resharded by DCP, the global data position read from
    rank 0's file, and the RNG not restored: the trainer re-seeds each rank; ``objective`` gets its
    state back (rank 0's, with ``same_ranks=False``, when the ranks differ).

    Any failure on any rank is raised on every rank (no rank is left waiting in a collective),
    as a :class:`CheckpointError` naming the directory.
    """
    path, rank = Path(path), dist.get_rank()
    error = None
    try:
        same_ranks = read_marker(path).get("world_size", dist.get_world_size()) == dist.get_world_size()
        train_state = torch.load(path / "train_state.pt", weights_only=True)
        # the data position is global (every rank saved the same); the RNG states are per rank
        rank_state = torch.load(path / f"rank-{rank if same_ranks else 0:05d}.pt", weights_only=True)
    except Exception as e:  # noqa: BLE001 - reported collectively below
        error = e
    _raise_if_any(error, path, device)
    try:
        if load_optimizer:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
            state = {"model": model_sd, "optimizer": optim_sd}
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=_options(model, loading=True))  # fmt: skip
        else:
            state = {"model": get_model_state_dict(model, options=_options(model))}
            dcp.load(state, checkpoint_id=str(path))
            set_model_state_dict(model, state["model"], options=_options(model, loading=True))
        sampler.load_state_dict(rank_state["sampler"])
        if rank_state.get("objective"):  # none in a checkpoint from before objectives had state
            objective.load_state_dict(rank_state["objective"], same_ranks)
        if load_rng and same_ranks:
            set_rng_state(rank_state["rng"], device)
    except (Exception, dcp.CheckpointException) as e:  # DCP's exception is a BaseException
        error = e
    _raise_if_any(error, path, device)
    return int(train_state["step"])


def _options(model, loading: bool = False) -> StateDictOptions:
    """LoRA runs keep only what trains (adapters, saved modules): the frozen base comes from
    ``model.path`` at every start, so a checkpoint is a small fraction of the model."""
    if not has_adapters(model):
        return StateDictOptions()
    return StateDictOptions(ignore_frozen_params=True, strict=not loading)


def _raise_if_any(error: BaseException | None, path: Path, device: torch.device) -> None:
    flag = torch.tensor([0 if error is None else 1], device=device if dist.get_backend() != "gloo" else "cpu")
    dist.all_reduce(flag)
    if error is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded: {type(error).__name__}: {error}") from error
    if flag.item():
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be loaded (failed on another rank, see its log)")
