"""torchrun, without its summary of a failed rank: what ``qwenkit train`` starts (``python -m qwenkit.torchrun``).

A module of its own so that the launcher process imports only torch's elastic launcher, not the
training kit (``qwenkit.launch`` pulls in transformers and distributed checkpointing, ~2 s more
of every ``qwenkit train`` on a 2-core machine).

Besides torch's own behaviour it

- tells its ranks its pid (``QWENKIT_AGENT_PID``), so a rank started after torchrun died exits;
- takes its launcher's death (``stopping.LAUNCHER_DIED``, the parent-death signal the launcher
  sets) as one SIGTERM, once, and not at all once it is stopping the ranks: Linux sends the
  parent-death signal again for every thread of the launcher that exits after the one that
  started torchrun, and a second signal into torch's agent while it stops the ranks makes it stop
  them again (its ``run`` closes the ranks again in ``finally``): they would get SIGTERM twice and
  stop at once, without their checkpoint (docs/TESTING.md);
- returns the ranks' exit code after a stop signal (torch raises its ``SignalException``):
  ``EXIT_RESUMABLE`` when every rank saved and stopped, else ``128 + signal``;
- names the rank that failed *first* (the order torchrun saw them exit, a signal death before an
  error exit seen in the same poll: the survivors of a killed rank fail with connection errors
  after it), with its signal, and returns that rank's code (``128 + N`` for signal N);
- with ``--events-dir=DIR`` (its first argument; the launcher gives the run's folder): writes the
  run's ``failed`` event (:func:`qwenkit.engine.run.events.launcher_failed`) when the rank that failed
  first did not write its own (killed by a signal, exited non-zero without a Python exception),
  when a stop signal ended ranks that had not saved, and when torchrun itself raised;
- with ``--max-restarts`` (c10d): restarts the group after a failure, not after ranks that
  saved and stopped (exit ``EXIT_RESUMABLE``: a stop was asked for, by a signal or
  ``train.stop_after``) nor after a rank's input error (it would recur), and says in the final headline how many restarts were used. The
  restarted ranks resume from the newest complete checkpoint (:func:`qwenkit.engine.run.rank.main` sets ``train.resume: auto``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from torch.distributed.elastic.agent.server.api import WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from qwenkit.engine.run import events
from qwenkit.engine.run.stopping import AGENT_PID_ENV, EXIT_RESUMABLE, LAUNCHER_DIED, shell_code
from qwenkit.errors import COMMAND_ENV

_first_seen: dict[int, tuple[int, float]] = {}  # pid -> (poll number, time) its failure was first seen
_final_codes: dict[int, int] = {}  # local rank -> exit code, after torchrun stopped the ranks
_polls = [0]
_restarts = [0]  # group restarts after a failure, this job
_run: list = [None, None]  # --events-dir, and an events.Follower of its events.jsonl from the current attempt on
_stopping = [False]  # the ranks are being stopped (or the launcher's death was taken): its death is no second stop


def _launcher_died(signum, frame) -> None:
    """``LAUNCHER_DIED``: one SIGTERM into torch's agent the first time, nothing after (see the module docstring)."""
    if _stopping[0]:
        return
    _stopping[0] = True
    raise SignalException(f"Process {os.getpid()} got signal: SIGTERM (its launcher died)", sigval=signal.SIGTERM)


def _record_failures(capture):
    def wrapped(self, done_local_ranks):
        _polls[0] += 1
        capture(self, done_local_ranks)
        for failure in self._failures.values():
            _first_seen.setdefault(failure.pid, (_polls[0], time.monotonic()))

    return wrapped


def _record_shutdown(shutdown):
    def wrapped(self, *args, **kwargs):
        _stopping[0] = True
        shutdown(self, *args, **kwargs)
        pcontext = getattr(self, "_pcontext", None)
        for local_rank, handler in getattr(pcontext, "subprocess_handlers", {}).items():
            if handler.proc.returncode is not None:
                _final_codes[local_rank] = handler.proc.returncode

    return wrapped


def _stops_are_not_failures(monitor):
    """End the job, never restart it, when the ranks that exit ``EXIT_RESUMABLE`` saved and stopped as
    asked, or when a rank recorded an input error (a bad row, a reward's value: every attempt would read
    the same files and fail alike)."""

    def wrapped(self, worker_group):
        result = monitor(self, worker_group)
        failures = getattr(result, "failures", None) or {}
        if failures and (all(f.exitcode == EXIT_RESUMABLE for f in failures.values()) or _input_failure()):
            self._remaining_restarts = 0
        return result

    return wrapped


def _count_restarts(restart):
    def wrapped(self, worker_group):
        if worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):  # not a membership change
            _restarts[0] += 1
            print(f"qwenkit {_command()}: the group failed; restart {_restarts[0]} of {worker_group.spec.max_restarts}: "
                  "the ranks resume from the newest complete checkpoint", file=sys.stderr, flush=True)  # fmt: skip
            if _run[1] is not None:
                _run[1] = events.Follower(_run[0])  # a rank's report of the failed attempt is not the next one's
        restart(self, worker_group)
        _stopping[0] = False  # the new ranks run: the launcher's death stops them again

    return wrapped


class _QuietStop(logging.Filter):
    """Drop torch's 'failed (exitcode: 75)' (a rank that saved and stopped did not fail), its 'failed'
    line of a rank's input error and of a subcommand's rank that exited 2 (each said it in one line),
    and its lines about forwarding a stop signal (the launcher said it in one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("failed (exitcode") and record.args and record.args[0] == EXIT_RESUMABLE:
            return False
        if msg.startswith("failed (exitcode") and _input_failure():  # a rank said it in one line
            return False
        if msg.startswith("failed (exitcode") and record.args and record.args[0] == USER_ERROR and _command() != "train":
            return False
        return not msg.startswith(("Received %s death signal", "Sending process %s closing signal"))


USER_ERROR = 2  # a subcommand's rank (qwenkit eval --nproc) that printed its input error in one line (cli.main)


def _command() -> str:
    """The subcommand whose ranks these are, in this wrapper's lines: ``train``, or the one that set :data:`COMMAND_ENV`."""
    return os.environ.get(COMMAND_ENV, "train")


def rank_env(rank: int, world_size: int, port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """The variables torchrun gives each rank of one node, for ranks started without it (the tests'
    and the benchmarks' spawned processes)."""
    return {"MASTER_ADDR": host, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}  # fmt: skip


def describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    if exitcode == EXIT_RESUMABLE:
        return f"stopped with a checkpoint (exit {EXIT_RESUMABLE})"
    return f"exited with {exitcode}"


def failure_message(failure) -> str:
    """What a rank's ProcessFailure says: its error file's message when the rank wrote one (torch's
    ``@record``), else how it ended."""
    said = failure.message if os.path.isfile(failure.error_file) else ""
    how = describe(failure.exitcode)
    if failure.exitcode == -signal.SIGKILL:
        how += " (by a person, the scheduler, or the kernel's out-of-memory killer: see dmesg)"
    elif failure.exitcode > 0:
        how += " without reporting a Python exception"
    return f"{how}: {events.first_line(said)}" if said else how


def _record(summary: str, *, error: str, message: str, exit_code: int, rank: int | None = None,
            signal_name: str | None = None) -> None:  # fmt: skip
    """The run's ``failed`` event, unless a rank of this attempt wrote one (``rank``: that rank's own)."""
    out, follower = _run
    if follower is None:
        return
    follower.poll()
    if not events.failed(follower.seen, rank):
        events.launcher_failed(out, summary, error=error, message=message, exit_code=exit_code, rank=rank,
                               signal=signal_name)  # fmt: skip


def _input_failure() -> dict | None:
    """The ``failed`` event of an input error a rank of this attempt recorded (:func:`qwenkit.engine.run.events.input_failure`)."""
    follower = _run[1]
    if follower is None:
        return None
    follower.poll()
    return events.input_failure(follower.seen)


def first_failure(failures: dict) -> tuple[int, object]:
    """The (global rank, ProcessFailure) that failed first: earliest poll, then a signal death."""

    def order(rank):
        f = failures[rank]
        poll, at = _first_seen.get(f.pid, (sys.maxsize, float("inf")))
        return (poll, 0 if f.exitcode < 0 else 1, at, rank)

    rank = min(failures, key=order)
    return rank, failures[rank]


def quiet_torchrun(argv: list[str], events_dir: str | None = None) -> int:
    """torchrun, without its summary of a failed rank (a second and third copy of its traceback).

    A qwenkit rank reports its own failure, one line then the traceback (see
    :func:`qwenkit.engine.run.rank.report_failure`), and exits with status 1; torchrun then stops the other
    ranks and raises ``ChildFailedError``, whose printout is replaced here by one line naming the
    rank that failed first. torchrun's own errors (bad arguments, rendezvous) still surface.
    ``events_dir``: the run folder whose ``events.jsonl`` gets the ``failed`` event no rank wrote.
    """
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    signal.signal(LAUNCHER_DIED, _launcher_died)
    # c10d: a fresh store for every attempt. The agent's shared store keeps the last attempt's keys,
    # and a restarted rank read its dead peer's gloo address from them (connection refused, 30 s)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if events_dir is not None:
        _run[:] = [events_dir, events.Follower(events_dir)]
    if hasattr(SubprocessContext, "_capture_process_failures"):  # torch >= 2.8; before, signal deaths first
        SubprocessContext._capture_process_failures = _record_failures(SubprocessContext._capture_process_failures)
    LocalElasticAgent._shutdown = _record_shutdown(LocalElasticAgent._shutdown)
    LocalElasticAgent._monitor_workers = _stops_are_not_failures(LocalElasticAgent._monitor_workers)
    LocalElasticAgent._restart_workers = _count_restarts(LocalElasticAgent._restart_workers)
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_QuietStop())
    try:
        torchrun_main(argv)
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        if failure.exitcode == EXIT_RESUMABLE:
            return EXIT_RESUMABLE
        if failure.exitcode == USER_ERROR and _command() != "train":  # the rank said it in one line (cli.main)
            return USER_ERROR
        if said := _input_failure():  # a bad row or reward: its one line is all people need
            if said.get("rank") != 0:  # rank 0 printed its own; another rank's is printed here
                print(said["summary"], file=sys.stderr, flush=True)
            return shell_code(failure.exitcode) or 1
        others = sorted(r for r in e.failures if r != rank)
        after = f"; then torchrun stopped rank(s) {', '.join(map(str, others))}" if others else ""
        if _restarts[0]:
            after += f" (after {_restarts[0]} restart(s) of the group, every one used)"
        line = f"qwenkit {_command()}: rank {rank} (pid {failure.pid}) failed first: {describe(failure.exitcode)}{after}"
        print(line, file=sys.stderr, flush=True)
        code = shell_code(failure.exitcode) or 1
        killed = failure.exitcode < 0
        _record(line, error="killed" if killed else "exited", message=failure_message(failure), exit_code=code,
                rank=rank, signal_name=failure.signal_name() if killed else None)  # fmt: skip
        return code
    except SignalException as e:
        codes = set(_final_codes.values())
        if codes == {EXIT_RESUMABLE}:
            return EXIT_RESUMABLE
        line = f"qwenkit {_command()}: stopped by {e.sigval.name}; rank exit codes {dict(sorted(_final_codes.items()))}"
        print(line, file=sys.stderr, flush=True)
        code = shell_code(-int(e.sigval))
        _record(line, error="stopped", message=f"{e.sigval.name} stopped ranks that had not saved a checkpoint",
                exit_code=code, signal_name=e.sigval.name)  # fmt: skip
        return code
    except Exception as e:  # torchrun's own failure (a rendezvous): recorded, then its traceback as ever
        _record(f"qwenkit {_command()}: torchrun failed: {type(e).__name__}: {events.first_line(e)}", error=type(e).__name__,
                message=events.first_line(e), exit_code=1)  # fmt: skip
        raise
    return 0


EVENTS_DIR = "--events-dir="  # the launcher's own first argument, never torchrun's


def main(argv: list[str]) -> int:
    events_dir = argv[0][len(EVENTS_DIR):] if argv and argv[0].startswith(EVENTS_DIR) else None
    return quiet_torchrun(argv[1:] if events_dir is not None else argv, events_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
