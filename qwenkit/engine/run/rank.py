"""One rank of a training run, as torchrun starts it: ``python -m qwenkit.engine.run.rank --config FILE``.

The rank reads the config the launcher wrote, sets up its log (``logs/rank-NNNNN.log``), installs
the stop-signal handler (:mod:`qwenkit.engine.run.stopping`) and runs :class:`qwenkit.engine.run.train.Trainer`.
A failure is reported once, as one line naming the rank, the exception and the log (the traceback
below it; of an input error or a failure of a known cause, in the log only: :func:`report_failure`), and
recorded as a ``failed`` event (:mod:`qwenkit.engine.run.events`); the rank then exits
with status 1 instead of raising (:func:`report_failure` says why). The exit status of a run that
stopped early to be continued is :data:`qwenkit.engine.run.stopping.EXIT_RESUMABLE`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path

from qwenkit import config as qconfig
from qwenkit.data.reader import DataError
from qwenkit.data.report import BadRows, BadSample
from qwenkit.distributed import fsdp
from qwenkit.engine.generation.answers import UserFunctionError
from qwenkit.engine.run import events, stopping
from qwenkit.engine.run.train import Trainer
from qwenkit.errors import TRACEBACK_ENV, EveryRank, KnownCause
from qwenkit.rundir import RunDir


def _setup_logging(rank: int, output_dir: Path) -> Path:
    """Console: INFO on rank 0, warnings on the others; every rank's INFO log in its own file.

    Returns that file, ``<output_dir>/logs/rank-NNNNN.log`` (appended to by a resumed run).
    """
    path = RunDir(output_dir).rank_log(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    console, file = logging.StreamHandler(), logging.FileHandler(path)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    for handler in (console, file):
        handler.setFormatter(fmt)
    logging.basicConfig(level=logging.INFO, handlers=[console, file])
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    return path


INPUT_ERRORS = (DataError, BadSample, BadRows, UserFunctionError)  # what the user fixes in their files: rows, rewards


def one_line(error: BaseException) -> bool:
    """Whether ``error``'s one line is all people need (its traceback goes to the log): an input error
    (:data:`INPUT_ERRORS`) or a failure of a known cause (:class:`qwenkit.errors.KnownCause`: a full disk
    at a save, an engine's known error), each saying what to fix. Its ``failed`` event says so
    (``input``): the launcher and the torchrun wrapper add nothing, and the group is not restarted."""
    return isinstance(error, (*INPUT_ERRORS, KnownCause))


def report_failure(rank: int, error: BaseException, log_path: Path | None, note: str = "", quiet: bool = False) -> str:
    """One line first (rank, exception, log), the traceback below it, once; returns the line.

    torchrun would print a failing rank's traceback up to three times (the rank, its error file,
    the agent's summary): the rank reports here and exits with status 1 instead of raising, and
    the torchrun wrapper the launcher runs (:func:`qwenkit.torchrun.quiet_torchrun`) keeps the
    agent's summary quiet.

    An input error (:data:`INPUT_ERRORS`: a bad row, too many bad rows, a reward that returns no
    number; each names its file and row, or reward and row) and a failure every rank raises alike
    (:class:`qwenkit.errors.EveryRank`) are the one line ``qwenkit train: <error> (rank N; its traceback:
    LOG)``; a rank's own failure of a known cause (:class:`qwenkit.errors.KnownCause`) is ``qwenkit train:
    rank N failed: <cause>; <fix> (its traceback: LOG)``. Either is on rank 0's console only (every rank
    reads the same rows; another rank's own is said by the torchrun wrapper, from its ``failed`` event);
    the traceback goes to the log, and to the console only with ``--traceback``. ``quiet``: the log only
    (a rank that lost its peer after the peer said why, :func:`main`).
    """
    message = events.first_line(error)
    where = f"log: {log_path}" if log_path is not None else "no log file: failed before logging started"
    details = "".join(traceback.format_exception(error))
    if one_line(error):
        log = log_path or "no log file"
        if isinstance(error, KnownCause) and not isinstance(error, EveryRank):
            line = f"qwenkit train: rank {rank} failed: {message} (its traceback: {log})"
        else:
            line = f"qwenkit train: {message} (rank {rank}; its traceback: {log})"
        shown = details if os.environ.get(TRACEBACK_ENV) == "1" else ""
        if rank == 0 and not quiet:
            print(f"{shown}{line}", file=sys.stderr, flush=True)
    else:
        line = f"qwenkit train: rank {rank} failed: {type(error).__name__}: {message} ({where})"
        if note:
            line += f"; {note}"
        if not quiet:
            print(f"{line}\n{details}", file=sys.stderr, flush=True)
    if log_path is not None:
        logging.shutdown()  # flush the file handler before appending to its file
        with open(log_path, "a") as f:
            f.write(f"{line}\n{details}")
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwenkit.engine.run.rank", description="one rank of a qwenkit training run")
    p.add_argument("--config", required=True, help="the resolved YAML the launcher wrote")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=30")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    if os.environ.get(stopping.AGENT_PID_ENV):
        stopping.die_with_parent()  # torchrun SIGKILLed: this rank goes with it
    stop = stopping.StopRequest.install()  # SIGTERM/SIGINT/SIGUSR1: save at the end of the step, exit 75
    log_path = trainer = cfg = peers = None
    try:
        cfg = qconfig.load(args.config, args.overrides)
        peers = events.Follower(cfg.train.output_dir)  # this job's events from now on: another rank's failure
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # parallel.max_restarts: after a failure
            cfg.train.resume, cfg.train.resume_older = "auto", False  # go on from this job's newest checkpoint
        log_path = _setup_logging(rank, Path(cfg.train.output_dir))
        trainer = Trainer(cfg, stop=stop)
        trainer.run()
    except Exception as e:  # noqa: BLE001 - every failure is reported the same readable way
        beat = trainer.heartbeat if trainer is not None else None
        note = beat.describe() if beat is not None and _looks_like_a_peer(e) else ""
        quiet = _looks_like_a_peer(e) and _a_peer_failed(peers, rank)  # its line said why: this one is the echo
        summary = report_failure(rank, e, log_path, note, quiet)
        if cfg is not None:
            events.EventLog(cfg.train.output_dir, rank).failed(e, summary, user_input=one_line(e))
        return 1
    return trainer.exit_code


def _a_peer_failed(peers: events.Follower | None, rank: int) -> bool:
    """Whether another rank of this job recorded its own failure: a rank writes its ``failed`` event
    before it exits, and only its exit closes its connections, so a peer's lost connection comes after."""
    if peers is None:
        return False
    peers.poll()
    return any(e.get("event") == "failed" and e.get("by") == "rank" and e.get("rank") != rank for e in peers.seen)


def _looks_like_a_peer(error: BaseException) -> bool:
    """A collective that timed out or lost its peer (gloo, NCCL): worth naming who went quiet."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(w in text for w in ("timed out", "timeout", "connection", "peer"))


if __name__ == "__main__":
    fsdp.exit_process(main())  # not sys.exit: see exit_process
