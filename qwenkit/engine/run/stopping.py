"""How a rank stops: on a signal (a checkpoint first), with its launcher, or when a peer hangs.

``qwenkit train`` (the launcher) forwards SIGTERM, SIGINT and SIGUSR1 to torchrun, which sends
them to every rank (each rank runs in its own session, so nothing else reaches it). A rank:

- on the **first** signal notes it (:class:`StopRequest`); the training loop finishes the
  current optimizer step, the ranks agree (:func:`agreed`, one all-reduce of a 0/1 flag per
  step: any rank that got the signal stops them all, at the same step), save a checkpoint
  together, log why, and exit with :data:`EXIT_RESUMABLE`;
- on a **second** signal prints one line and exits at once with ``128 + signal``;
- dies with its parent (:func:`die_with_parent`: Linux ``PR_SET_PDEATHSIG``), so a SIGKILLed
  torchrun never leaves ranks training with nobody watching;
- beats a heartbeat into the job's store (:class:`Heartbeat`), so that a rank whose collective
  timed out (``parallel.timeout_s``) can say which peer stopped answering.

Exit codes (the launcher passes them on): 0 training complete (``train.steps`` reached);
:data:`EXIT_RESUMABLE` (75, ``EX_TEMPFAIL``) stopped with a checkpoint saved before
``train.steps`` (a signal, or ``train.stop_after``): run the same command again to go on;
``128 + N`` killed by signal N (137: SIGKILL; 143: a second SIGTERM); 1 a rank failed; 2 refused
before any process started. See docs/CHECKPOINTS.md.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

EXIT_RESUMABLE = 75  # sysexits' EX_TEMPFAIL: a checkpoint is saved and more steps remain; run again
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
AGENT_PID_ENV = "QWENKIT_AGENT_PID"  # torchrun's pid, set by qwenkit.torchrun for its ranks
# torchrun's parent-death signal (the launcher died): not a stop signal torch forwards, so
# qwenkit.torchrun takes it once however often the kernel sends it (docs/TESTING.md)
LAUNCHER_DIED = signal.SIGUSR2
PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def shell_code(exitcode: int) -> int:
    """A process's exit status as a shell reports it: ``128 + N`` for a death by signal N
    (``subprocess``'s ``-N``); the one rule of the launcher, torchrun's wrapper and a rank."""
    return 128 - exitcode if exitcode < 0 else exitcode


def die_with_parent(expected_parent_env: str = AGENT_PID_ENV, sig: int = signal.SIGKILL) -> None:
    """This rank dies with torchrun (its parent). Exits now if that parent is already gone."""
    set_parent_death_signal(sig)
    expected = os.environ.get(expected_parent_env)
    if expected and os.getppid() != int(expected):  # the parent died before the prctl took hold
        print(f"qwenkit train: rank {os.environ.get('RANK', '?')}: its torchrun (pid {expected}) is gone; stopping",
              file=sys.stderr, flush=True)  # fmt: skip
        os._exit(shell_code(-int(sig)))


class StopRequest:
    """The first stop signal this process got (``None`` until one comes); a second exits at once."""

    def __init__(self):
        self.signal: signal.Signals | None = None
        self.at: float | None = None

    @classmethod
    def install(cls, signals=STOP_SIGNALS) -> StopRequest:
        request = cls()
        for sig in signals:
            signal.signal(sig, request._handle)
        return request

    def _handle(self, signum, frame) -> None:
        sig = signal.Signals(signum)
        rank = os.environ.get("RANK", "0")
        if self.signal is not None:
            os.write(2, f"qwenkit train: rank {rank}: second stop signal ({sig.name}): stopping at once, no checkpoint\n".encode())
            os._exit(128 + signum)
        self.signal, self.at = sig, time.time()
        # no logging here: a handler may run inside a logging call (its lock is not reentrant)

    @property
    def name(self) -> str | None:
        return self.signal.name if self.signal is not None else None


def agreed(request: StopRequest | None, device) -> bool:
    """Collective: True on every rank when any rank got a stop signal (one all-reduce)."""
    import torch
    import torch.distributed as dist

    local = 1 if request is not None and request.signal is not None else 0
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return bool(local)
    flag = torch.tensor([local], device=device if dist.get_backend() != "gloo" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


# ---------------------------------------------------------------------------------------------
# Heartbeat: who stopped answering


class Heartbeat:
    """Every ``period`` s, this rank's time and step in the job's store (a daemon thread).

    A thread, not the training loop: a rank blocked in a collective still beats (its native
    collectives release the GIL), a SIGSTOPped or wedged process does not. After a collective
    timeout, :meth:`peers` tells which ranks went quiet.
    """

    PREFIX = "qwenkit/heartbeat/"

    def __init__(self, store, rank: int, world_size: int, period: float):
        self.store, self.rank, self.world_size, self.period = store, rank, world_size, period
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="qwenkit-heartbeat", daemon=True)

    @classmethod
    def start_default(cls, rank: int, world_size: int, timeout_s: float) -> Heartbeat | None:
        import torch.distributed as dist

        if world_size < 2 or not dist.is_initialized():
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, AttributeError, ValueError):
            return None
        beat = cls(store, rank, world_size, period=max(0.5, min(5.0, timeout_s / 6)))
        beat._beat_once()
        beat._thread.start()
        return beat

    def _beat_once(self) -> None:
        self.store.set(f"{self.PREFIX}{self.rank}", json.dumps({"time": time.time(), "step": self.step}))

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._beat_once()
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return

    def stop(self) -> None:
        self._stop.set()

    def peers(self) -> dict[int, dict]:
        """Every other rank's last beat: ``{rank: {"age": seconds, "step": n}}`` (age None: never)."""
        found = {}
        now = time.time()
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = f"{self.PREFIX}{r}"
            try:
                if not self.store.check([key]):
                    found[r] = {"age": None, "step": None}
                    continue
                beat = json.loads(self.store.get(key))
                found[r] = {"age": now - beat["time"], "step": beat["step"]}
            except Exception:  # noqa: BLE001 - the store itself is gone
                found[r] = {"age": None, "step": None}
        return found

    def describe(self) -> str:
        """Which ranks stopped answering, in a few words (for the failure line)."""
        stale_after = 3 * self.period
        peers = self.peers()
        quiet = {r: p for r, p in peers.items() if p["age"] is None or p["age"] > stale_after}
        if not quiet:
            return (f"every other rank still beats (within {stale_after:.0f} s): they are alive but not in the same "
                    "collective, or one is still busy")  # fmt: skip
        parts = []
        for r, p in sorted(quiet.items()):
            if p["age"] is None:
                parts.append(f"rank {r} (no heartbeat)")
            else:
                parts.append(f"rank {r} (silent for {p['age']:.0f} s, last at step {p['step']})")
        return "stopped answering: " + ", ".join(parts)
