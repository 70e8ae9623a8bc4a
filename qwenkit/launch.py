"""``qwenkit train``: validate the config, check the run before spawning, and start torchrun.

One path for every size: even ``--nproc 1`` runs under torchrun, so a rank always sees the same
environment. The config is loaded and checked (keys, types, ranges, and
:func:`qwenkit.engine.run.prespawn.check_before_spawn`: the model directory, the dataset path, the
resume point) *before* any process starts; the ranks read the resolved YAML this launcher
writes, and rank 0 writes it to ``<output_dir>/config.yaml`` (what ``qwenkit export`` finds
later) once the start is accepted, so a start that fails never rewrites a run's record.

Multi-node: run the same command on every node with ``--nnodes N --node-rank i
--master-addr <node 0's address>`` (default port 6000; on one node a free port, so concurrent
jobs on one machine never collide), or with no flags under Slurm, a Kubeflow PyTorchJob or
PAI-DLC, whose environment says the same (:mod:`qwenkit.cluster`). The exit status is torchrun's: non-zero
when any rank fails (torchrun then stops the others and prints the failing rank's error).
With ``parallel.rendezvous: c10d`` torchrun's elastic rendezvous is used instead (no node ranks,
``--nnodes MIN:MAX``), and ``parallel.max_restarts`` restarts the group after a failure: the
restarted ranks resume from the newest complete checkpoint (see docs/CLUSTERS.md).

One folder, one job: the launcher holds an ``flock`` on ``<output_dir>/.qwenkit-node-<i>.lock``
(``<i>``: the node rank; under c10d, which numbers the nodes itself, the host name; its pid,
host and start time inside) for the job's lifetime, torchrun inherits it; a second
``qwenkit train`` into that folder is refused naming the holder. The kernel drops the lock when
its holders exit however they exit, so a lock left by a dead job is simply taken over. The ranks
read ``<output_dir>/.config-<host>-<pid>.yaml``, written by this launcher alone.

Signals (see docs/CHECKPOINTS.md): SIGTERM, SIGINT and SIGUSR1 are forwarded to torchrun (which
runs in its own process group, so a terminal's Ctrl-C reaches it once, through here); the ranks
finish their step, save a checkpoint and exit with ``EXIT_RESUMABLE`` (75); a second signal stops
them at once. With ``vllm.mode: server`` and no ``vllm.server_url`` the launcher first starts the run's vLLM
server (:func:`qwenkit.engine.generation.vllm_server.start`), tells the ranks its URL (``QWENKIT_VLLM_SERVER_URL``)
and stops it when torchrun ends. torchrun gets ``stopping.LAUNCHER_DIED`` when this process dies
(``PR_SET_PDEATHSIG``) and stops the ranks as for one SIGTERM; the ranks get SIGKILL when
torchrun dies.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from qwenkit import config as qconfig
from qwenkit.cluster import MULTINODE_PORT, ClusterError, Rendezvous, free_port, settle
from qwenkit.config.rules import vllm as vllm_rules
from qwenkit.config.vllm import SERVER_URL_ENV
from qwenkit.device import CPU_MALLOC_ENV, resolve_device
from qwenkit.engine.checkpoints import init_from, teacher
from qwenkit.engine.generation import vllm_server
from qwenkit.engine.generation.vllm_client import ServerGone
from qwenkit.engine.run import events, stopping
from qwenkit.engine.run.prespawn import check_before_spawn
from qwenkit.errors import print_user_error
from qwenkit.rundir import RunDir
from qwenkit.torchrun import EVENTS_DIR

STOP_GRACE_S = 1800  # torchrun waits this long for the ranks' checkpoint after a signal, then SIGKILLs


def rendezvous_port(rdzv: Rendezvous) -> int:
    if rdzv.master_port is not None:
        return rdzv.master_port
    return free_port(rdzv.master_addr) if rdzv.most_nodes == 1 else MULTINODE_PORT


def node_name(rdzv: Rendezvous) -> str:
    """This node in its lock file's name: its rank, or under c10d (ranks taken as nodes join) its
    host (``HOSTNAME``: a pod's name in Kubernetes)."""
    return str(rdzv.node_rank) if rdzv.backend == "static" else os.environ.get("HOSTNAME") or socket.gethostname()


def rank_environment(cfg, base: dict[str, str]) -> dict[str, str]:
    """The ranks' environment: ``base`` plus the CPU allocator setting when ranks run on CPU."""
    env = dict(base)
    device = cfg.parallel.device
    if device == "cpu" or (device == "auto" and resolve_device("auto") == "cpu"):
        for key, value in CPU_MALLOC_ENV.items():
            env.setdefault(key, value)
    return env


def torchrun_stop_options() -> list[str]:
    """torchrun's options that forward SIGUSR1 too and wait for the ranks' save (torch >= 2.8 has
    them; older torchruns forward SIGTERM/SIGINT only and wait 30 s: see :func:`spawn`)."""
    from torch.distributed.launcher.api import LaunchConfig

    fields = LaunchConfig.__dataclass_fields__
    options = []
    if "signals_to_handle" in fields:
        options.append("--signals_to_handle=" + ",".join(s.name for s in (*stopping.STOP_SIGNALS, signal.SIGHUP, signal.SIGQUIT)))
    if "shutdown_timeout" in fields:
        options.append(f"--shutdown_timeout={STOP_GRACE_S}")
    return options


def torchrun_command(config_path: Path, nproc: int, rdzv: Rendezvous, events_dir: Path | None = None) -> list[str]:
    """torchrun's command line, run through :func:`qwenkit.torchrun.quiet_torchrun`. Every
    rendezvous option is given, so the operator's ``PET_*`` variables (torchrun's defaults) never
    change the rendezvous the launcher checked and logged. ``events_dir``: the run folder where
    the wrapper records a failure no rank recorded."""
    if rdzv.backend == "c10d":
        where = ["--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv.master_addr}:{rendezvous_port(rdzv)}",
                 f"--rdzv-id={rdzv.rdzv_id}"]  # fmt: skip
    else:
        where = ["--rdzv-backend=static", f"--node-rank={rdzv.node_rank}", f"--master-addr={rdzv.master_addr}",
                 f"--master-port={rendezvous_port(rdzv)}"]  # fmt: skip
    return [
        sys.executable, "-m", "qwenkit.torchrun",
        *([f"{EVENTS_DIR}{events_dir}"] if events_dir is not None else []),
        *torchrun_stop_options(),
        f"--nnodes={rdzv.nodes}",
        f"--nproc-per-node={nproc}",
        *where,
        f"--max-restarts={rdzv.max_restarts}",
        "-m", "qwenkit.engine.run.rank", "--config", str(config_path),
    ]  # fmt: skip


class OutputDirBusy(RuntimeError):
    """Another live ``qwenkit train`` holds the output_dir's lock."""


def lock_path(output_dir: str | Path, node: int | str = 0) -> Path:
    return Path(output_dir) / f".qwenkit-node-{node}.lock"


def acquire_lock(output_dir: str | Path, node: int | str = 0) -> int | None:
    """Hold ``<output_dir>/.qwenkit-node-<i>.lock`` (an ``flock``); returns its file descriptor.

    The kernel releases it when every process holding the descriptor (this one, torchrun) exits,
    however it exits: a lock left by a dead job is taken over. Raises :class:`OutputDirBusy`
    naming the live holder. Returns None, with a warning, on a filesystem without locks.
    """
    path = lock_path(output_dir, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "{}"
        os.close(fd)
        try:
            info = json.loads(holder)
            who = f"pid {info.get('pid')} on {info.get('host')}, since {info.get('since')}"
        except ValueError:
            who = holder
        raise OutputDirBusy(
            f"train.output_dir={str(output_dir)!r} is in use by another qwenkit train ({who}; lock {path}); "
            "wait for it, stop it, or use another train.output_dir"
        ) from None
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            os.close(fd)
            print(f"qwenkit train: warning: {path.parent} does not support file locks ({e.strerror}): "
                  "nothing stops a second job in this output_dir", file=sys.stderr)  # fmt: skip
            return None
        raise
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    except OSError:
        pass  # a full disk: the lock holds all the same, only the holder's name is missing
    return fd


def _torchrun_child() -> None:
    """In torchrun's process before exec: its own process group, and ``LAUNCHER_DIED`` when we die
    (which :mod:`qwenkit.torchrun` takes as one SIGTERM, however many times it comes)."""
    os.setpgid(0, 0)
    stopping.set_parent_death_signal(stopping.LAUNCHER_DIED)


def spawn(cmd: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> int:
    """Run torchrun; forward SIGTERM/SIGINT/SIGUSR1 to it; returns its exit status."""
    proc = subprocess.Popen(cmd, env=env, pass_fds=pass_fds, preexec_fn=_torchrun_child)
    received: list[int] = []
    usr1_as_term = not any(option.startswith("--signals_to_handle") for option in cmd)  # an older torchrun

    def forward(signum, frame):
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            print(f"qwenkit train: {name}: every rank finishes its step, saves a checkpoint and stops "
                  f"(exit {stopping.EXIT_RESUMABLE}); send it again to stop at once", file=sys.stderr, flush=True)  # fmt: skip
        else:
            print(f"qwenkit train: {name} again: stopping at once", file=sys.stderr, flush=True)
        try:
            proc.send_signal(signal.SIGTERM if usr1_as_term and signum == signal.SIGUSR1 else signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in stopping.STOP_SIGNALS}
    try:
        code = proc.wait()
        if code < 0:  # torchrun itself killed by a signal: its ranks died with it (PR_SET_PDEATHSIG)
            print(f"qwenkit train: torchrun (pid {proc.pid}) was killed by {signal.Signals(-code).name}; "
                  "its ranks were stopped with it", file=sys.stderr, flush=True)  # fmt: skip
            code = stopping.shell_code(code)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _write_or_say(what: str, fn, *args):
    """``fn(*args)`` (a write), or None after one line naming what could not be written and why."""
    try:
        return fn(*args)
    except OSError as e:
        print(f"qwenkit train: cannot write {what}: {e.strerror or e} ({getattr(e, 'filename', None) or what})", file=sys.stderr)
        return None


def launch(
    config: str | None, overrides: list[str], nproc: int | None = None, rdzv: Rendezvous = Rendezvous(),
    rendezvous_source: str | None = None,
) -> int:
    """``qwenkit train``: ``config`` (a params YAML or None for the defaults) with dotted
    ``overrides``; ``nproc`` overrides ``parallel.nproc``; ``rendezvous_source``: where ``rdzv``
    was found (logged once, with the rendezvous the config settles). Returns the exit status."""
    overrides = list(overrides)
    if nproc is not None:
        overrides.append(f"parallel.nproc={nproc}")
    cfg = None
    try:
        cfg = qconfig.load(config, overrides)
        rdzv = settle(rdzv, cfg.parallel)
    except (qconfig.ConfigError, ClusterError) as e:
        print_user_error("train", e)
        if cfg is not None:  # a config that does not load names no folder to record it in
            record_refusal(cfg, f"qwenkit train: {e}")
        return 2
    if rdzv.backend == "c10d":
        rendezvous_source = (f"{rendezvous_source}; " if rendezvous_source else "") + (
            f"c10d rendezvous {rdzv.rdzv_id!r} at {rdzv.master_addr}:{rendezvous_port(rdzv)}, "
            f"{rdzv.nodes} node(s), {rdzv.max_restarts} restart(s)"
        )
    if rendezvous_source:
        print(f"qwenkit train: {rendezvous_source}", file=sys.stderr, flush=True)
    if rdzv.backend == "static" and not 0 <= rdzv.node_rank < rdzv.nnodes:
        line = f"qwenkit train: --node-rank must be in [0, --nnodes={rdzv.nnodes}), got {rdzv.node_rank}"
        print(line, file=sys.stderr)
        return record_refusal(cfg, line)
    # model.init_from: the run it starts from, trained first when missing, exported once
    stopped = init_from.prepare(cfg, lambda recipe, extra: launch(recipe, extra, nproc, rdzv))
    if stopped is not None:
        return record_refusal(cfg, f"qwenkit train: model.init_from={cfg.model.init_from!r}: the run to start from is not "
                       f"ready (exit {stopped}; the lines above say why)", stopped)  # fmt: skip
    if (said := teacher.prepare(cfg)) is not None:  # distill.teacher: a run's checkpoint exported once
        print(said, file=sys.stderr)
        return record_refusal(cfg, said)
    out = Path(cfg.train.output_dir)
    node = node_name(rdzv)
    lock = None
    try:
        if out.is_dir():  # a job there now: say so before anything else
            lock = acquire_lock(out, node)
        problems = check_before_spawn(cfg, rdzv.most_nodes, rdzv.nnodes)
        if problems:
            listed = problems[0] if len(problems) == 1 else "\n  - " + "\n  - ".join(problems)  # one: one line
            print(f"qwenkit train: invalid run: {listed}", file=sys.stderr)
            return record_refusal(cfg, "qwenkit train: invalid run: " + "; ".join(problems), message=problems[0])
        if lock is None:
            lock = _write_or_say(str(lock_path(out, node)), acquire_lock, out, node)
            if lock is None and not out.is_dir():
                return 2
        return _launch_locked(cfg, rdzv, lock)
    except OutputDirBusy as e:
        print_user_error("train", e)  # no event: the folder's stream is the live job's
        return 2
    finally:
        if lock is not None:
            os.close(lock)  # torchrun's copy is closed with torchrun: the lock is free now


def own_server(cfg) -> bool:
    """Whether this run starts its own vLLM server (``vllm.mode: server``, ``vllm.server_url`` empty, a key asking for vLLM)."""
    return cfg.vllm.mode == "server" and not cfg.vllm.server_url and bool(vllm_rules.engines(cfg))


def record_refusal(cfg, summary: str, code: int = 2, message: str | None = None) -> int:
    """``code``, after the run's ``failed`` event for a refusal (the console line is printed already)."""
    events.launcher_failed(cfg.train.output_dir, summary, error="refused",
                           message=message or summary.removeprefix("qwenkit train: "), exit_code=code)  # fmt: skip
    return code


def torchrun_ended(out: Path, code: int) -> None:
    """The ``failed`` event when torchrun ended non-zero and neither a rank nor its wrapper said why
    (torchrun killed by a signal, or refusing its arguments)."""
    sig = next((s.name for s in signal.Signals if code > 128 and s.value == code - 128), None)
    how = f"torchrun was killed by {sig}" if sig else f"torchrun exited with {code}"
    events.launcher_failed(out, f"qwenkit train: {how} without naming a failed rank", error="torchrun",
                           message=how, exit_code=code, signal=sig)  # fmt: skip


def _launch_locked(cfg, rdzv: Rendezvous, lock: int | None) -> int:
    run = RunDir(cfg.train.output_dir)
    out = run.path
    # the ranks read a file only this launcher wrote; the run's record (config.yaml, for export and
    # for people) is rank 0's to write once the start is accepted: a start that fails leaves it as it was
    rank_config = out / f".config-{socket.gethostname()}-{os.getpid()}.yaml"
    if _write_or_say(str(rank_config), qconfig.write_config, cfg, out, rank_config.name) is None:
        return record_refusal(cfg, f"qwenkit train: cannot write {rank_config}")
    since = events.Follower(out)  # this job's events: torchrun's wrapper or a rank may record the failure
    server = None
    try:
        env = rank_environment(cfg, os.environ)
        if own_server(cfg):  # vllm.mode=server, no vllm.server_url: this run's own, up before the ranks
            try:
                server = vllm_server.start(cfg, rank_config, env, free_port("127.0.0.1"))
            except ServerGone as e:
                print(f"qwenkit train: {e}", file=sys.stderr)
                return record_refusal(cfg, f"qwenkit train: {e}", 1)
            env[SERVER_URL_ENV] = server.url
            print(f"qwenkit train: vLLM server at {server.url} (pid {server.process.pid}, log {server.log_path})", flush=True)
        cmd = torchrun_command(rank_config, cfg.parallel.nproc, rdzv, events_dir=out)
        print(f"qwenkit train: {shlex.join(cmd)}", flush=True)
        code = spawn(cmd, env, pass_fds=() if lock is None else (lock,))
    finally:
        rank_config.unlink(missing_ok=True)
        if server is not None:
            server.stop()
    since.poll()
    if code not in (0, stopping.EXIT_RESUMABLE) and not events.failed(since.seen):
        torchrun_ended(out, code)
    logs = run.logs
    if code == stopping.EXIT_RESUMABLE:
        print(f"qwenkit train: stopped with a checkpoint saved before train.steps={cfg.train.steps} "
              f"(exit {code}, see {run.rank_log(0)}): run the same command again to continue", file=sys.stderr)  # fmt: skip
    elif code != 0 and not events.input_failure(since.seen):  # an input error: its rank's one line said it
        print(
            f"qwenkit train: failed with exit code {code}; the rank that failed first is named above "
            f"(its own error in its 'qwenkit train: rank N failed' line), every rank's log is in {logs}/",
            file=sys.stderr,
        )
    return code
