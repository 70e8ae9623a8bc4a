"""Run a function on N gloo ranks in fresh processes, the way torchrun would set them up.

Each rank gets torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``)
and one CPU thread. The function must be importable from a test module (spawn pickles it by
name); ranks report back through files, not return values. A rank ends the way a trainer's rank
does, through :func:`qwenkit.distributed.fsdp.exit_process` (status 0, or 1 after printing the
traceback of what it raised).

Timeouts here catch hangs, not slowness: a 2-rank module fixture that takes ~60 s on a quiet
2-core machine was killed at a 180 s timeout while another job shared the cores. The default
is 15 minutes, and ``QWENKIT_TEST_TIMEOUT_SCALE`` multiplies it and every other test timeout
that goes through :func:`scaled` (e.g. 3 on a machine busy with other work).
"""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.multiprocessing as mp

from qwenkit.cluster import free_port
from qwenkit.distributed.fsdp import exit_process
from qwenkit.torchrun import rank_env

DEFAULT_TIMEOUT_S = 900.0


def scaled(seconds: float) -> float:
    """A test timeout: ``seconds`` (what a hang needs to be told from a slow machine) x the scale."""
    return seconds * float(os.environ.get("QWENKIT_TEST_TIMEOUT_SCALE", "1"))


def _entry(fn, rank: int, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    except Exception:  # noqa: BLE001 - reported here, as multiprocessing would
        traceback.print_exc()
        exit_process(1)
    exit_process(0)  # as a trainer's rank ends (python -m qwenkit.engine.run.rank): no interpreter teardown


def run_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S, context: str = "spawn") -> list[int]:
    """Start ``fn(rank, *args)`` on each rank; returns the exit codes. ``timeout`` is scaled.

    When one rank fails, the others are terminated (they would wait in a collective forever).
    ``context="forkserver"`` forks the ranks from a server that imported torch (and the modules
    given to ``set_forkserver_preload``) once: for tests that start many short jobs.
    """
    ctx = mp.get_context(context)
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + scaled(timeout)
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


def check_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    codes = run_ranks(fn, world_size, *args, timeout=timeout)
    if any(codes):
        raise AssertionError(f"ranks exited with codes {codes} (tracebacks above)")
