"""``checkpoint.async``'s machinery: the gloo group and the stager a background save uses, and the
thread that writes and then checksums a rank's files (:func:`qwenkit.engine.checkpoints.dcp.start_save`
starts a save on them; :func:`~qwenkit.engine.checkpoints.dcp.finish` completes it)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist

from qwenkit.engine.checkpoints.files import write_manifest


def then_manifest(written: Future, tmp: Path, rank: int) -> Future:
    """The background write, then this rank's manifest in the same thread: reading the files back
    for their CRC-32s does not block training either. Not a daemon: a process that ends while it
    runs waits for it (the checkpoint still gets no COMPLETE.json without :func:`~qwenkit.engine.checkpoints.dcp.finish`)."""
    done: Future = Future()

    def run():
        try:
            written.result()
            write_manifest(tmp, rank)
            done.set_result(None)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is one; finish() reports it
            done.set_exception(e)

    threading.Thread(target=run, name="qwenkit-checkpoint-write").start()
    return done


class AsyncSaves:
    """What ``checkpoint.async`` keeps from save to save (collective to build: every rank at once).

    - a gloo group for the background writes: their collectives (DCP's plan and metadata
      exchange) run in a thread and must never interleave with training's;
    - a stager whose CPU copies are reused from save to save (torch >= 2.9; older ones copy into
      new memory each time, before ``async_save`` returns): one save is in flight at a time, so a
      copy is never refilled while its write still reads it. It copies in a thread of its own
      (``use_async_staging``), so the next step's forward and backward overlap the copy; pinned
      memory when the model is on an accelerator.
    """

    def __init__(self, device: torch.device):
        self.group = dist.new_group(backend="gloo")
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:
            self.stager = None
        else:
            pinned = device.type != "cpu"
            self.stager = DefaultStager(StagingOptions(pinned, False, True, False))

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
