"""A checkpoint folder on disk: its layout, finding checkpoints, integrity, pruning, setting aside.

No torch here: the launcher reads checkpoints through this module before any process starts
(:mod:`qwenkit.engine.checkpoints.resume` decides which one a start resumes); the DCP save and load that
write and read them are :mod:`qwenkit.engine.checkpoints.dcp`.

Layout: ``<output_dir>/checkpoints/step-00000012/`` (see :mod:`qwenkit.engine.checkpoints.dcp`)
with ``COMPLETE.json`` written last; ``.tmp-step-*`` (a save under way or killed) and
``.prune-step-*`` (a delete under way) never count; ``damaged-*`` and ``superseded-*`` hold
checkpoints moved out of reach of ``resume: auto`` and pruning, never deleted.

Integrity: ``COMPLETE.json`` lists every file's size and CRC-32. :func:`check_files` names the
first file that is missing, truncated or (with ``checksums``) damaged.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from pathlib import Path

from qwenkit.rundir import RunDir

COMPLETE = "COMPLETE.json"
PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
PRUNE_PREFIX = ".prune-step-"
MANIFEST = "manifest-rank-{rank:05d}.json"
CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names its directory."""


# ---------------------------------------------------------------------------------------------
# Finding checkpoints


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX) :])


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


def run_config_path(checkpoint: str | Path) -> Path:
    """The resolved config a run saved in its output_dir (``<output_dir>/config.yaml``)."""
    ckpt = resolve(checkpoint)
    path = RunDir(ckpt.parent.parent).config
    if not path.is_file():
        raise FileNotFoundError(f"no config.yaml in the run directory {str(ckpt.parent.parent)!r}; pass --config")
    return path


# ---------------------------------------------------------------------------------------------
# Integrity


def crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_marker(path: Path) -> dict:
    """``COMPLETE.json`` of ``path``; a :class:`CheckpointError` naming it when empty or invalid."""
    marker_path = Path(path) / COMPLETE
    try:
        text = marker_path.read_text()
        marker = json.loads(text)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r}: {COMPLETE} is missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        what = "empty" if not text.strip() else f"not valid JSON ({e})" if isinstance(e, ValueError) else str(e)
        raise CheckpointError(f"checkpoint {str(path)!r}: {COMPLETE} is {what}") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: {COMPLETE} is not a JSON object")
    return marker


def check_files(path: Path, checksums: bool = False, rank: int = 0, world_size: int = 1) -> str | None:
    """What is wrong with checkpoint ``path`` (``None``: nothing found), naming the file.

    Sizes of every file always; with ``checksums``, the CRC-32 of this rank's share of the files
    (every ``world_size``-th, from ``rank``). A marker from before checksums (no ``files``) only
    needs to be valid JSON.
    """
    path = Path(path)
    try:
        marker = read_marker(path)
    except CheckpointError as e:
        return str(e)
    files = marker.get("files")
    if files is None:
        return None
    for i, (name, (size, crc)) in enumerate(sorted(files.items())):
        file = path / name
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            return f"checkpoint {str(path)!r}: {name} is missing"
        if actual != size:
            return f"checkpoint {str(path)!r}: {name} is {actual} bytes, {size} were saved (truncated or replaced)"
        if checksums and i % world_size == rank:
            found = crc32_file(file)
            if found != crc:
                return f"checkpoint {str(path)!r}: {name} fails its checksum (CRC-32 {found:08x}, {crc:08x} saved): damaged"
    return None


def checkpoint_bytes(path: Path) -> int:
    """The bytes of a complete checkpoint's files, as ``COMPLETE.json`` lists them (else as they are on disk)."""
    files = read_marker(path).get("files")
    if files is None:
        return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())
    return sum(size for size, _ in files.values())


def older_complete(path: Path, damaged=()) -> Path | None:
    """The newest complete checkpoint older than ``path`` next to it that passes :func:`check_files`."""
    damaged = {Path(p) for p in damaged}
    try:
        step = step_of(path)
    except ValueError:
        return None
    for candidate in reversed(complete_checkpoints(path.parent)):
        if step_of(candidate) < step and candidate not in damaged and check_files(candidate) is None:
            return candidate
    return None


def damaged_error(problem: str, path: Path, damaged=()) -> CheckpointError:
    older = older_complete(path, damaged)
    offer = (f"the newest older complete checkpoint is {str(older)!r} (train.resume={older}, or train.resume=auto "
             "falls back to it)") if older else "there is no older complete checkpoint"  # fmt: skip
    return CheckpointError(f"{problem}; {offer}")


# ---------------------------------------------------------------------------------------------
# Moving and removing: a checkpoint stops counting (a rename) before any of its files goes


def set_aside(newer: list[Path]) -> Path | None:
    """Move ``newer`` checkpoints into ``checkpoints/superseded-<time>/``; returns that directory."""
    if not newer:
        return None
    dest = newer[0].parent / f"superseded-{time.strftime('%Y%m%dT%H%M%S')}"
    dest.mkdir()
    for path in newer:
        os.rename(path, dest / path.name)
    fsync_dir(newer[0].parent)
    return dest


def set_aside_damaged(path: Path) -> Path:
    """Move a damaged checkpoint to ``checkpoints/damaged-<name>-<time>/`` (kept for a look, never resumed)."""
    dest = path.parent / f"damaged-{path.name}-{time.strftime('%Y%m%dT%H%M%S')}"
    os.rename(path, dest)
    fsync_dir(path.parent)
    return dest


def prunable(root: Path, written: Path, keep_last: int) -> list[Path]:
    """What ``keep_last`` lets a save of ``written`` remove: the oldest of the checkpoints before it.

    ``written`` counts as one of the kept; checkpoints of later steps are never touched.
    """
    older = [p for p in complete_checkpoints(root) if step_of(p) < step_of(written)]
    return older[: max(0, len(older) - (keep_last - 1))]


def prune(path: Path) -> None:
    """Delete a checkpoint: renamed to ``.prune-step-*`` first, so it stops counting before any file goes."""
    aside = path.parent / f"{PRUNE_PREFIX}{path.name[len(PREFIX) :]}"
    os.rename(path, aside)
    fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
