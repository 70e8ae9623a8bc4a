"""Run a function on N gloo ranks in fresh processes, the way torchrun would set them up.

Each rank gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``)
and one CPU thread. The function must be importable from a test module (spawn pickles it by
name); ranks report back through files, not return values.
"""

from __future__ import annotations

import os
import time

import torch
import torch.multiprocessing as mp

from qwenkit.launch import free_port


def _entry(fn, rank: int, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    fn(rank, *args)


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0) -> list[int]:
    """Start ``fn(rank, *args)`` on each rank; returns the exit codes.

    When one rank fails, the others are terminated (they would wait in a collective forever).
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            time.sleep(2.0)  # let the other ranks fail on their own first
            for p in procs:
                if p.is_alive():
                    p.terminate()
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    return [p.exitcode for p in procs]


def check_ranks(fn, world_size: int, *args, timeout: float = 180.0) -> None:
    codes = run_ranks(fn, world_size, *args, timeout=timeout)
    if any(codes):
        raise AssertionError(f"ranks exited with codes {codes} (tracebacks above)")
