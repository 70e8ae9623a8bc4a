"""Training checkpoints with torch.distributed.checkpoint (DCP) and resume (the HF export: :mod:`qwenkit.engine.export`).

A checkpoint is a directory ``<output_dir>/checkpoints/step-00000012/`` holding

- the DCP files of ``{"model": ..., "optimizer": ...}`` from ``get_state_dict`` (each rank writes
  its own shards; a load reshards them to whatever the loading job's sharding is);
- ``train_state.pt``: the step (the same on every rank, written by rank 0);
- ``rank-00000.pt`` ...: per rank, the data position (``sampler.state_dict()``) and the RNG
  states of python, numpy, torch CPU and the accelerator;
- ``COMPLETE.json``, written last.

Saving is atomic: everything is written under ``.tmp-step-00000012``; after a barrier (every
rank done) rank 0 writes ``COMPLETE.json`` and renames the directory. A save killed midway
leaves a ``.tmp-*`` directory that is never picked as latest (and is removed by the next save),
so the previous checkpoint stays the one a resume selects.

No checkpoint is lost by surprise: a save never replaces a complete checkpoint, and pruning
(``checkpoint.keep_last``) removes only checkpoints *older* than the one just written, never it
and never a newer one. Resuming from a checkpoint older than the newest in the output_dir (or
starting fresh next to checkpoints) would write over that newer history, so it is refused
unless ``train.resume_older`` is set; then the newer checkpoints are moved, whole, to
``checkpoints/superseded-<time>/`` (out of reach of ``resume: auto`` and pruning), never deleted.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
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

from qwenkit.model.lora import has_adapters

log = logging.getLogger(__name__)
COMPLETE = "COMPLETE.json"
PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names its directory."""


# ---------------------------------------------------------------------------------------------
# Finding checkpoints


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``.tmp-*`` and unmarked ones never count)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir()
        if p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and (p / COMPLETE).is_file()
    ]  # fmt: skip
    return sorted(found, key=step_of)


def latest(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


def newer_checkpoints(resume: Path | None, output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir`` past the resume point (all of them for a fresh start)."""
    start = 0 if resume is None else int(json.loads((resume / COMPLETE).read_text())["step"])
    return [p for p in complete_checkpoints(checkpoint_root(output_dir)) if step_of(p) > start]


def older_resume_problem(resume: Path | None, output_dir: str | Path) -> str | None:
    """The problem with resuming there (``None`` when no newer checkpoint would be written over)."""
    newer = newer_checkpoints(resume, output_dir)
    if not newer:
        return None
    start = f"train.resume={str(resume)!r}" if resume is not None else "a fresh start (train.resume=none)"
    return (
        f"{start} is older than checkpoints in {str(checkpoint_root(output_dir))!r}: "
        f"{', '.join(p.name for p in newer)}; resume from the newest (train.resume=auto), use another "
        "train.output_dir, or set train.resume_older=true to move them to checkpoints/superseded-<time>/"
    )


def set_aside(newer: list[Path]) -> Path | None:
    """Move ``newer`` checkpoints into ``checkpoints/superseded-<time>/``; returns that directory."""
    if not newer:
        return None
    dest = newer[0].parent / f"superseded-{time.strftime('%Y%m%dT%H%M%S')}"
    dest.mkdir()
    for path in newer:
        os.rename(path, dest / path.name)
    _fsync_dir(newer[0].parent)
    return dest


def find_resume(resume: str, output_dir: str | Path) -> Path | None:
    """The checkpoint ``train.resume`` asks for: ``auto`` (newest complete, or none), ``none``, or a path."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest(checkpoint_root(output_dir))
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise CheckpointError(f"train.resume={resume!r}: not a complete checkpoint directory (no {COMPLETE})")
    return path


def resume_point(train_cfg, output_dir: str | Path) -> Path | None:
    """The checkpoint a run resumes from (None: a fresh start), or :class:`CheckpointError` if it must not start.

    The one resume rule, checked by the launcher before any rank starts and by every rank:
    ``train.resume`` must name a complete checkpoint (or ``auto``/``none``), and newer complete
    checkpoints in ``output_dir`` are never written over unless ``train.resume_older`` (then the
    caller moves them aside with :func:`set_aside`).
    """
    resume = find_resume(train_cfg.resume, output_dir)
    problem = older_resume_problem(resume, output_dir)
    if problem and not train_cfg.resume_older:
        raise CheckpointError(problem)
    return resume


def resolve(path: str | Path) -> Path:
    """A step directory as is; a run's output_dir or checkpoints dir becomes its newest checkpoint."""
    path = Path(path)
    if (path / COMPLETE).is_file():
        return path
    for root in (path, checkpoint_root(path)):
        found = latest(root)
        if found is not None:
            return found
    raise CheckpointError(f"{str(path)!r}: no complete checkpoint there (looked for {COMPLETE})")


# ---------------------------------------------------------------------------------------------
# RNG


def rng_state(device: torch.device) -> dict:
    """python, numpy, torch CPU and accelerator generator states, in types torch.load(weights_only) reads."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {**np_state, "state": {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}},
        "torch": torch.get_rng_state(),
    }
    if device.type != "cpu":
        state["accelerator"] = torch.get_device_module(device.type).get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    key = np.asarray(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state({**np_state, "state": {"key": key, "pos": np_state["state"]["pos"]}})
    torch.set_rng_state(state["torch"])
    if device.type != "cpu" and "accelerator" in state:
        torch.get_device_module(device.type).set_rng_state(state["accelerator"], device)


# ---------------------------------------------------------------------------------------------
# Save


def save(root: str | Path, step: int, model, optimizer, sampler, device: torch.device, keep_last: int) -> Path:
    """Collective: every rank calls it. Returns the final directory.

    Raises :class:`CheckpointError` on every rank, before writing anything, when a complete
    checkpoint of that step exists already (the trainer refuses the runs that would get here).
    """
    root, rank = Path(root), dist.get_rank()
    tmp, final = root / f"{TMP_PREFIX}{step:08d}", step_dir(root, step)
    if (final / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {str(final)!r} exists already; a save never replaces one")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{TMP_PREFIX}*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
    _write(tmp / f"rank-{rank:05d}.pt", {"rng": rng_state(device), "sampler": sampler.state_dict()})
    if rank == 0:
        _write(tmp / "train_state.pt", {"step": step})
    dist.barrier()  # every rank's files are on disk
    if rank == 0:
        marker = {"step": step, "world_size": dist.get_world_size(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        _write_text(tmp / COMPLETE, json.dumps(marker))
        if final.exists():  # an incomplete leftover (no COMPLETE.json), never a finished checkpoint
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        for old in prunable(root, final, keep_last):
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def prunable(root: Path, written: Path, keep_last: int) -> list[Path]:
    """What ``keep_last`` lets a save of ``written`` remove: the oldest of the checkpoints before it.

    ``written`` counts as one of the kept; checkpoints of later steps are never touched.
    """
    older = [p for p in complete_checkpoints(root) if step_of(p) < step_of(written)]
    return older[: max(0, len(older) - (keep_last - 1))]


def _write(path: Path, obj) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Load


def load(path: str | Path, model, optimizer, sampler, device: torch.device,
         load_optimizer: bool = True, load_rng: bool = True) -> int:
    """Collective: restore a checkpoint into the (sharded) model and the rest; returns its step.

    The LR schedule is not restored: it is a function of the step and the run's config, which
    the trainer applies after the load (see ``qwenkit.engine.train.build_scheduler``).

    Any failure on any rank is raised on every rank (no rank is left waiting in a collective),
    as a :class:`CheckpointError` naming the directory.
    """
    path, rank = Path(path), dist.get_rank()
    error = None
    try:
        marker = json.loads((path / COMPLETE).read_text())
        if marker["world_size"] != dist.get_world_size():
            raise CheckpointError(
                f"saved by {marker['world_size']} ranks, this job has {dist.get_world_size()}: the data "
                "position and RNG are per rank (model and optimizer could be resharded, the data order not)"
            )
        train_state = torch.load(path / "train_state.pt", weights_only=True)
        rank_state = torch.load(path / f"rank-{rank:05d}.pt", weights_only=True)
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
        if load_rng:
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


def run_config_path(checkpoint: str | Path) -> Path:
    """The resolved config a run saved in its output_dir (``<output_dir>/config.yaml``)."""
    ckpt = resolve(checkpoint)
    path = ckpt.parent.parent / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no config.yaml in the run directory {str(ckpt.parent.parent)!r}; pass --config")
    return path
