"""A save's files on disk: what each rank wrote (its manifest), the check that every rank sees
every rank's files, and the one line that says why writing them failed.

:mod:`qwenkit.engine.checkpoints.dcp` runs the collective save; it calls these at its two points that
touch the files themselves. After each rank has written, :func:`write_manifest` lists the size
and CRC-32 of that rank's files; every rank then reads every manifest back
(:func:`gather_manifests`), so ranks on nodes without one shared ``output_dir`` are found before
anything is marked complete, and the merged list becomes ``COMPLETE.json``'s ``files``. When a
rank's write failed, :func:`failure_message` tells a full disk (:func:`is_enospc`, or what the
saving rank noted) and a file larger than may be written (:func:`is_efbig`, ``ulimit -f``) from any
other error, naming the disk's mount point, the bytes free and about the bytes needed; every rank
raises it as one :class:`SaveError` (a failure of a known cause, said in one line).

No torch here: only the files, their checksums (:func:`qwenkit.engine.checkpoints.folder.crc32_file`)
and the exceptions DCP raises, read through their ``failures`` and causes.
"""

from __future__ import annotations

import errno
import json
import os
import resource
from pathlib import Path

from qwenkit.engine.checkpoints.folder import MANIFEST, CheckpointError, crc32_file
from qwenkit.errors import EveryRank, KnownCause


def write_text(path: Path, text: str) -> None:
    """``text`` at ``path``, flushed to the disk before this returns."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(tmp: Path, rank: int) -> None:
    """``manifest-rank-N.json``: the size and CRC-32 of every file this rank wrote into ``tmp``."""
    manifest = {name: [(tmp / name).stat().st_size, crc32_file(tmp / name)] for name in files_of_rank(tmp, rank)}
    write_text(tmp / MANIFEST.format(rank=rank), json.dumps(manifest))


def files_of_rank(tmp: Path, rank: int) -> list[str]:
    """The files rank ``rank`` wrote into ``tmp``: DCP names its shards ``__<rank>_<i>.distcp``;
    the coordinator (rank 0) writes ``.metadata`` and ``train_state.pt``."""
    names = {n for n in os.listdir(tmp) if n.startswith(f"__{rank}_") and n.endswith(".distcp")}
    names.add(f"rank-{rank:05d}.pt")
    if rank == 0:
        names.update(n for n in (".metadata", "train_state.pt") if (tmp / n).is_file())
    return sorted(names)


def gather_manifests(tmp: Path, world: int, rank: int) -> tuple[dict, str | None]:
    """All ranks' manifests merged, as this rank sees them, or the first file it does not see."""
    files = {}
    for r in range(world):
        manifest = tmp / MANIFEST.format(rank=r)
        try:
            listed = json.loads(manifest.read_text())
        except (OSError, ValueError):
            return {}, f"rank {rank} does not see rank {r}'s files in {str(tmp)!r} (no {manifest.name})"
        for name, (size, crc) in listed.items():
            try:
                actual = (tmp / name).stat().st_size
            except FileNotFoundError:
                return {}, f"rank {rank} does not see {name} (written by rank {r}) in {str(tmp)!r}"
            if actual != size:
                return {}, f"rank {rank} sees {name} (written by rank {r}) with {actual} bytes, {size} were written"
            files[name] = [size, crc]
        files[manifest.name] = [manifest.stat().st_size, crc32_file(manifest)]
    return files, None


def causes(error: BaseException):
    """``error``, its causes, and the per-rank failures inside DCP's CheckpointException."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in getattr(e, "failures", {}).values() if isinstance(getattr(e, "failures", None), dict) else ():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def is_enospc(error: BaseException) -> bool:
    """Whether ``error`` or any of its causes is a full disk or quota (ENOSPC, EDQUOT)."""
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in causes(error))


def is_efbig(error: BaseException) -> bool:
    """Whether ``error`` or any of its causes is a file larger than may be written (EFBIG)."""
    return any(isinstance(e, OSError) and e.errno == errno.EFBIG for e in causes(error))


def file_size_limit() -> int | None:
    """This process's largest file in bytes (``ulimit -f``, RLIMIT_FSIZE), None without one."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


class SaveError(CheckpointError, KnownCause, EveryRank):
    """A save that failed on some rank, raised on every rank with the one line of :func:`failure_message`
    (the run stops; the partial save is removed, the previous checkpoint stays the newest complete one)."""


def one_line(error: BaseException) -> str:
    """``Type: message`` of the first OSError among the causes (the one that names the file), else of ``error``."""
    for e in causes(error):
        if isinstance(e, OSError):
            return f"{type(e).__name__}: {e}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def failure_message(step: int, tmp: Path, failed: list[dict], needed: int, free: int) -> str:
    """Why step ``step`` was not saved, from the failed ranks' reports (``ranks``, ``enospc``, ``efbig``,
    ``limit``, ``error``): a full disk or quota (the bytes free and about the bytes the save needs), a file
    larger than may be written (EFBIG: the file-size limit), or the first error."""
    ranks = ", ".join(str(r) for r in sorted({r for report in failed for r in report["ranks"]}))
    if any(r["enospc"] for r in failed):
        where = mount_point(tmp.parent)
        return (f"checkpoint step {step} not saved: the disk of {str(tmp.parent)!r} (mounted at {where}) is full: "
                f"{free:,} bytes free, this save needs about {needed:,} bytes (rank {ranks})")  # fmt: skip
    if big := [r for r in failed if r.get("efbig")]:
        limit = min((r["limit"] for r in big if r.get("limit") is not None), default=None)
        why = f"this process's file-size limit is {limit:,} bytes (ulimit -f)" if limit is not None else \
              "the filesystem's largest file"  # fmt: skip
        return (f"checkpoint step {step} not saved: a file of it in {str(tmp.parent)!r} is larger than rank {ranks} "
                f"may write (EFBIG: {why}): this save needs about {needed:,} bytes, "
                f"{max(r['nbytes'] for r in big):,} of them from rank {big[0]['rank']}")  # fmt: skip
    return f"checkpoint step {step} not saved: rank {ranks} failed to write it: {failed[0]['error']}"


def mount_point(path: Path) -> str:
    """The mount point of the filesystem that holds ``path``."""
    path = Path(path).resolve()
    dev = path.stat().st_dev
    while path.parent != path and path.parent.stat().st_dev == dev:
        path = path.parent
    return str(path)
