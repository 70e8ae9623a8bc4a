"""The one resume rule: which checkpoint a start resumes, and whether it may.

:func:`decide` is asked by the launcher before any process starts (file sizes checked) and by
every rank in :func:`agree` (checksums, each rank its share, and every rank seeing the same
checkpoints); ``qwenkit train``'s refusals and the ranks' are the same sentences. The rule itself
uses no torch (the data files it compares are listed by :func:`qwenkit.data.load.file_sizes`);
:func:`agree` is the ranks' collective around it.

- ``train.resume``: ``auto`` takes the newest complete checkpoint that passes the check, passing
  over damaged ones (returned in ``skipped``: the ranks move them to ``damaged-*``); ``none``
  starts fresh; a path must be a complete checkpoint that passes the check, or the error names
  the damaged file and the newest older complete checkpoint.
- Newer complete checkpoints in ``output_dir`` are never written over: a resume behind them (or a
  fresh start next to them) is refused unless ``train.resume_older``; then ``newer`` lists them
  and rank 0 moves them, whole, to ``superseded-<time>/``.
- The checkpoint must hold what this run trains (:data:`STATE_KEYS`: the family, the model's
  shape, the objective, LoRA on or off and its targets) and read the same data (JSON files
  against the tiny set or a ``datasets`` folder); a run that differs is refused before any process
  starts, naming the keys, so the run's ``config.yaml`` is never rewritten by a start that fails.
- The checkpoint must fit the run (:func:`fit`): the same data order (``train.seed``,
  ``data.shuffle``, ``data.max_tokens_per_batch``, and ``data.packing`` under a token budget),
  checked from ``COMPLETE.json``'s ``run`` record before any process starts, and the same data
  files (their sizes, :func:`qwenkit.data.load.file_sizes`; the ranks then check the rows and
  their lengths, which also covers ``tiny`` and ``datasets`` sources). The number of
  ranks, ``parallel.sp_size``, the HSDP shape, the micro-batch size and the accumulation may
  change: DCP reshards the model and optimizer, the data position is global, the RNG is
  re-seeded per rank (:func:`rank_seed`), and ``changes`` says what changed, for the log. A
  token budget fills the micro-batches an epoch is cut into, ``M`` per step: it needs the same
  ``M`` (data-parallel ranks x ``train.grad_accum``). A checkpoint from before the ``run``
  record needs the same number of ranks.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from qwenkit.data.load import file_sizes
from qwenkit.engine.checkpoints.folder import (
    COMPLETE,
    PREFIX,
    CheckpointError,
    check_files,
    checkpoint_root,
    complete_checkpoints,
    damaged_error,
    read_marker,
    set_aside,
    set_aside_damaged,
    step_of,
)
from qwenkit.model.families.spec import of_run

log = logging.getLogger(__name__)


@dataclass
class Resume:
    """What :func:`decide` found: the checkpoint to resume (None: a fresh start) and what to move."""

    path: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # damaged, passed over by auto
    newer: list[Path] = field(default_factory=list)  # past the resume point: moved aside (resume_older)
    changes: list[str] = field(default_factory=list)  # how this run differs from the saved one (for the log)
    same_ranks: bool = True  # saved by as many ranks: each rank's RNG state is restored


# what a data order depends on (a resume needs them equal); under a token budget data.packing too
ORDER_KEYS = ("train.seed", "data.shuffle", "data.max_tokens_per_batch", "data.eval_fraction")
# what the saved model and optimizer state are (a resume needs them equal: else DCP fails in the ranks)
STATE_KEYS = (
    "model.name", "model.shape", "train.objective",
    "lora.r", "lora.target_modules", "lora.vision", "lora.modules_to_save", "lora.use_dora",
)  # fmt: skip
# the numbers of a model directory's config.json that shape its tensors ("model.shape")
SHAPE_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "num_experts", "moe_intermediate_size", "depth", "num_heads", "out_hidden_size",
)  # fmt: skip


def run_record(cfg, world_size: int) -> dict:
    """What ``COMPLETE.json`` records of the run that saved a checkpoint (``run``), by config key."""
    return {
        "world_size": world_size, "data_ranks": world_size // cfg.parallel.sp_size,
        "train.micro_batch_size": cfg.train.micro_batch_size, "train.grad_accum": cfg.train.grad_accum,
        "train.seed": cfg.train.seed, "data.shuffle": cfg.data.shuffle,
        "data.max_tokens_per_batch": cfg.data.max_tokens_per_batch, "data.packing": cfg.data.packing,
        "data.eval_fraction": cfg.data.eval_fraction, "data.files": file_sizes(cfg.data),
        "train.objective": cfg.train.objective, **{f"lora.{k}": getattr(cfg.lora, k) for k in _LORA_KEYS},
        **model_record(cfg.model),
    }  # fmt: skip


_LORA_KEYS = tuple(k.removeprefix("lora.") for k in STATE_KEYS if k.startswith("lora."))


def model_record(model_cfg) -> dict:
    """``model.name`` (the family, ``auto`` resolved) and ``model.shape`` (:data:`SHAPE_KEYS` of the
    model directory's ``config.json``, ``text.*`` / ``vision.*``, and tied embeddings); empty when
    the directory cannot be read (the launcher reports that itself)."""
    try:
        spec = of_run(model_cfg)
    except (OSError, ValueError):
        return {}
    config, name = spec.model_config, spec.family.name  # a whole Omni checkpoint's: its thinker's
    shape = {"tie_word_embeddings": bool(config.get("tie_word_embeddings", False))}
    for part, section in (("text", config.get("text_config") or config), ("vision", config.get("vision_config") or {})):
        shape |= {f"{part}.{k}": section[k] for k in SHAPE_KEYS if k in section}
    return {"model.name": name, "model.shape": shape}


def decide(cfg, world_size: int | None, check: Callable[[Path], str | None] = check_files) -> Resume:
    """The checkpoint this start of ``cfg`` on ``world_size`` ranks resumes; :class:`CheckpointError`
    when the start is refused.

    ``check(path)`` returns what is wrong with a checkpoint (``None``: usable); the launcher
    passes :func:`~qwenkit.engine.checkpoints.folder.check_files` (sizes), the ranks a collective
    checksum check. ``world_size`` None skips :func:`fit` (a look at the folder alone).
    """
    train_cfg, output_dir = cfg.train, Path(cfg.train.output_dir)
    resume = train_cfg.resume
    found, skipped = None, []
    if resume == "auto":
        for candidate in reversed(complete_checkpoints(checkpoint_root(output_dir))):
            problem = check(candidate)
            if problem is None:
                found = candidate
                break
            skipped.append((candidate, problem))
        if found is None and skipped:
            raise CheckpointError(f"train.resume=auto: no usable checkpoint, every one is damaged: "
                                  f"{'; '.join(p for _, p in skipped)}")  # fmt: skip
    elif resume != "none":
        found = Path(resume)
        if not (found / COMPLETE).is_file():
            raise CheckpointError(f"train.resume={resume!r}: not a complete checkpoint directory (no {COMPLETE})")
        problem = check(found)
        if problem:
            raise damaged_error(f"train.resume={resume!r}: {problem}", found)
    changes, same_ranks = [], True
    if found is not None and world_size is not None:
        changes, same_ranks = fit(found, read_marker(found), run_record(cfg, world_size))
    newer = newer_checkpoints(found, output_dir, ignore=[p for p, _ in skipped])
    if newer and not train_cfg.resume_older:
        start = f"train.resume={str(found)!r}" if found is not None else "a fresh start (train.resume=none)"
        raise CheckpointError(
            f"{start} is older than checkpoints in {str(checkpoint_root(output_dir))!r}: "
            f"{', '.join(p.name for p in newer)}; resume from the newest (train.resume=auto), use another "
            "train.output_dir, or set train.resume_older=true to move them to checkpoints/superseded-<time>/"
        )
    return Resume(found, skipped, newer, changes, same_ranks)


def fit(path: Path, marker: dict, now: dict) -> tuple[list[str], bool]:
    """``(changes, same ranks)`` of resuming checkpoint ``path`` as the run ``now``
    (:func:`run_record`); :class:`CheckpointError` where the resume cannot be exact in data order."""
    saved = marker.get("run")
    if saved is None:  # from before the run record: per-rank data positions
        saved_by = marker.get("world_size")
        if saved_by is not None and saved_by != now["world_size"]:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was saved by {saved_by} ranks, this run has {now['world_size']} "
                f"(parallel.nproc x --nnodes), and it is from before qwenkit recorded global data positions: "
                f"run with {saved_by} ranks or start another train.output_dir"
            )
        return [], True
    state_problem = _state_problem(path, saved, now)
    if state_problem:
        raise CheckpointError(state_problem)
    changed = _changed_files(saved["data.files"], now["data.files"]) if "data.files" in saved else []
    if changed:
        raise CheckpointError(
            f"cannot resume the data order of checkpoint {str(path)!r}: the dataset changed since it was saved "
            f"({'; '.join(changed)}): put back the data it was trained on to continue that run, or train on the "
            "changed data in another train.output_dir"
        )
    keys = ORDER_KEYS + (("data.packing",) if saved["data.max_tokens_per_batch"] else ())
    keys = tuple(k for k in keys if k in saved)  # a record from before a key was added: the ranks check
    wrong = [f"{k} saved {saved[k]!r}, now {now[k]!r}" for k in keys if saved[k] != now[k]]
    if wrong:
        undo = " ".join(f"{k}={saved[k]}".lower() if isinstance(saved[k], bool) else f"{k}={saved[k]}"
                        for k in keys if saved[k] != now[k])  # fmt: skip
        raise CheckpointError(
            f"cannot resume the data order of checkpoint {str(path)!r}: {'; '.join(wrong)}: set {undo} to continue "
            "that run, or start the new settings in another train.output_dir"
        )
    per_step = {k: v["data_ranks"] * v["train.grad_accum"] for k, v in (("saved", saved), ("now", now))}
    if saved["data.max_tokens_per_batch"] and per_step["saved"] != per_step["now"]:
        m, dp = per_step["saved"], now["data_ranks"]
        choice = f"train.grad_accum={m // dp}" if m % dp == 0 else f"data-parallel ranks x train.grad_accum = {m}"
        raise CheckpointError(
            f"cannot resume the data order of checkpoint {str(path)!r} on these ranks: data.max_tokens_per_batch "
            f"cuts each epoch into micro-batches, {m} per step ({saved['data_ranks']} data-parallel ranks x "
            f"train.grad_accum={saved['train.grad_accum']}), this run takes {per_step['now']} "
            f"({dp} x train.grad_accum={now['train.grad_accum']}): set {choice}, or start another train.output_dir"
        )
    return _changes(saved, now), saved["world_size"] == now["world_size"]


def _state_problem(path: Path, saved: dict, now: dict) -> str | None:
    """Why checkpoint ``path`` does not hold what the run ``now`` trains (:data:`STATE_KEYS`), or None.
    A key the saved record lacks (a checkpoint from before it was recorded) is not compared."""
    differ = [k for k in STATE_KEYS if k in saved and k in now and saved[k] != now[k]]
    if not differ:
        return None
    said = []
    for k in differ:
        if k == "model.shape":
            keys = sorted(set(saved[k]) | set(now[k]))
            said += [f"model.shape ({k2} saved {saved[k].get(k2)}, now {now[k].get(k2)} in model.path's config.json)"
                     for k2 in keys if saved[k].get(k2) != now[k].get(k2)]  # fmt: skip
        else:
            said.append(f"{k} saved {saved[k]!r}, now {now[k]!r}")
    keys = ", ".join(k.replace("model.shape", "model.path") for k in differ)  # the shape is model.path's
    return (
        f"cannot resume checkpoint {str(path)!r}: it holds another model or objective than this run trains "
        f"({'; '.join(said)}): set {keys} back to continue that run; or start from its weights with "
        f"model.init_from={str(path.parent.parent)!r} in another train.output_dir; or start fresh in another train.output_dir "
        "(or here with train.resume=none train.resume_older=true, its checkpoints moved aside)"
    )


def _changed_files(saved: dict | None, now: dict | None) -> list[str]:
    """The data files (:func:`qwenkit.data.load.file_sizes`) added, removed or resized, in words.
    Not comparable (a checkpoint from before the record, or ``tiny`` and ``datasets`` sources on
    both sides): the ranks check."""
    if (saved is None) != (now is None):
        return ["the saved run read " + ("JSON files" if saved else "the tiny set or a datasets folder")
                + ", this one reads " + ("JSON files" if now else "the tiny set or a datasets folder")]
    if saved is None or now is None:
        return []
    out = [f"data file {n!r} had {saved[n]} bytes, now {now[n]}" for n in saved if n in now and saved[n] != now[n]]
    out += [f"data file {n!r} is gone" for n in saved if n not in now]
    return out + [f"data file {n!r} is new" for n in now if n not in saved]


def _changes(saved: dict, now: dict) -> list[str]:
    """What differs between the saved run and this one, in words (empty: the same shape)."""
    shape = ("world_size", "data_ranks", "train.micro_batch_size", "train.grad_accum")
    if all(saved[k] == now[k] for k in shape):
        return []
    out = [f"{k} {saved[k]} -> {now[k]}" for k in shape if saved[k] != now[k]]
    if not saved["data.max_tokens_per_batch"]:
        glob = {k: v["data_ranks"] * v["train.micro_batch_size"] * v["train.grad_accum"] for k, v in
                (("saved", saved), ("now", now))}  # fmt: skip
        if glob["saved"] == glob["now"]:
            out.append(f"global batch {glob['now']} samples kept: each step takes the samples it would have")
        else:
            out.append(f"global batch {glob['saved']} -> {glob['now']} samples: the epoch goes on from its position, "
                       "each sample once, in other steps than the saved run's")  # fmt: skip
    if saved["world_size"] != now["world_size"]:
        out.append("RNG re-seeded per rank from (train.seed, step, rank)")
    return out


def rank_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank resumed on another number of ranks: a function of the run's seed, the step and the rank."""
    return zlib.crc32(f"{seed}/{step}/{rank}".encode())


def newer_checkpoints(resume: Path | None, output_dir: str | Path, ignore=()) -> list[Path]:
    """Complete checkpoints in ``output_dir`` past the resume point (all of them for a fresh start)."""
    start = 0 if resume is None else _resume_step(resume)
    ignore = {Path(p) for p in ignore}
    return [p for p in complete_checkpoints(checkpoint_root(output_dir)) if step_of(p) > start and p not in ignore]


def _resume_step(resume: Path) -> int:
    try:
        return int(read_marker(resume)["step"])
    except (CheckpointError, KeyError, TypeError, ValueError):
        return step_of(resume) if resume.name.startswith(PREFIX) else 0


def agree(cfg, rank: int, world_size: int) -> Resume:
    """The checkpoint this start resumes, by :func:`decide` (the rule the launcher asked too),
    verified and agreed by every rank (collective: every rank calls it, under a process group).

    Every rank must see the same checkpoints (else: no shared output_dir, refused). The files'
    checksums are verified, each rank reading its share; ``resume: auto`` passes over a damaged
    one (saying so) and rank 0 moves it aside; with ``train.resume_older`` rank 0 moves the newer
    checkpoints aside (not deleted). The launcher refused the runs the rule refuses before any
    rank started; this covers ranks started another way.
    """
    main_rank = rank == 0
    root = checkpoint_root(cfg.train.output_dir)
    seen = [(p.name, _marker_text(p)) for p in complete_checkpoints(root)]
    views = [None] * world_size
    dist.all_gather_object(views, seen)
    if any(v != views[0] for v in views):
        differ = next(r for r, v in enumerate(views) if v != views[0])
        raise CheckpointError(
            f"the ranks do not see the same checkpoints in {str(root)!r}: rank 0 sees "
            f"{[n for n, _ in views[0]] or 'none'}, rank {differ} sees {[n for n, _ in views[differ]] or 'none'}: "
            "every node must write to one train.output_dir (a filesystem shared by every node)"
        )

    def check(path: Path) -> str | None:  # collective: each rank checksums its share of the files
        problem = check_files(path, checksums=True, rank=rank, world_size=world_size)
        problems = [None] * world_size
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p), None)
        if problem and cfg.train.resume == "auto" and main_rank:
            log.warning("train.resume=auto: %s; falling back to the newest older complete checkpoint", problem)
        return problem

    decision = decide(cfg, world_size, check)
    dist.barrier()  # every rank has looked before rank 0 moves anything
    if main_rank:
        for path, _ in decision.skipped:
            log.warning("moved the damaged %s to %s", path.name, set_aside_damaged(path))
        if decision.newer:
            log.warning("train.resume_older: moved the newer checkpoints to %s", set_aside(decision.newer))
    dist.barrier()
    return decision


def _marker_text(path: Path) -> str:
    try:
        return (path / COMPLETE).read_text()
    except OSError:
        return ""
