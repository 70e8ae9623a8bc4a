"""``qwenkit train``: validate the config, write it to the run's output_dir, and start torchrun.

One path for every size: even ``--nproc 1`` runs under torchrun, so a rank always sees the same
environment. The config is loaded and checked (keys, types, ranges, the model directory, the
dataset path) *before* any process starts; the resolved YAML written to
``<output_dir>/config.yaml`` is what every rank reads and what ``qwenkit export`` finds later.

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
them at once. torchrun gets SIGTERM when this process dies (``PR_SET_PDEATHSIG``), the ranks
SIGKILL when torchrun dies.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from qwenkit import config as qconfig
from qwenkit.cluster import MULTINODE_PORT, ClusterError, Rendezvous, free_port, settle
from qwenkit.data.conversation import parse_row
from qwenkit.data.reader import DataError, open_sources
from qwenkit.device import CPU_MALLOC_ENV, device_count, resolve_device
from qwenkit.distributed import fsdp, sequence
from qwenkit.engine import events, init_from, optim, stopping
from qwenkit.engine import resume as resume_rule
from qwenkit.errors import print_user_error
from qwenkit.model import family as families
from qwenkit.model import lora, registry
from qwenkit.model.paths import resolve_path
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


def check_before_spawn(cfg, rdzv: Rendezvous = Rendezvous()) -> list[str]:
    """Problems that would otherwise surface only inside every rank; empty when all is well."""
    problems = []
    try:
        path = resolve_path(cfg.model)  # writes the tiny checkpoint once, before ranks race for it
    except FileNotFoundError as e:
        problems.append(str(e))
    else:  # module paths, LoRA targets, saved modules and parameter-group patterns against the module tree (on meta)
        problems.extend(check_module_paths(cfg))
        problems.extend(families.problems(cfg, path))  # what the family cannot run: SP, packing, fused ops...
        heads = sequence.heads_problem_of(path, cfg.parallel.sp_size)
        if heads:
            problems.append(heads)
    if cfg.data.path != "tiny" and not Path(cfg.data.path).expanduser().exists():
        problems.append(f"data.path={cfg.data.path!r} does not exist")
    else:
        problems.extend(check_extras(cfg))
    problems.extend(check_resume(cfg, cfg.parallel.nproc * rdzv.most_nodes))  # c10d: the ranks check the world they get
    ranks = rank_count_problem(cfg.parallel)
    if ranks:
        problems.append(ranks)
    hsdp = fsdp.hsdp_problem(cfg.parallel)
    if hsdp:
        problems.append(hsdp)
    return problems


def check_extras(cfg) -> list[str]:
    """Optional extras this run needs that are not installed, one line each naming the pip extra
    (the ranks would fail only after the model is built, with a ``ModuleNotFoundError``).

    ``train.report_to: [mlflow]`` and ``model.fused_backend`` are refused by the config check
    already. The dataset is looked at only when ``datasets`` or PyAV is missing: its sources are
    opened (a Hugging Face dataset then fails, naming its extra), and without PyAV its rows are
    parsed for videos.
    """
    problems = []
    if cfg.lora.r > 0 and not qconfig.installed("peft"):
        problems.append(f"lora.r={cfg.lora.r} needs peft, which is not installed: pip install 'qwenkit[lora]'")
    if "tensorboard" in cfg.train.report_to and not qconfig.installed("tensorboard"):
        problems.append("train.report_to: tensorboard needs the tensorboard package, which is not installed: "
                        "pip install 'qwenkit[tensorboard]'")  # fmt: skip
    if cfg.data.path == "tiny" or (qconfig.installed("datasets") and qconfig.installed("av")):
        return problems
    paths = [cfg.data.path] + ([cfg.data.eval_path] if cfg.data.eval_path else [])
    for path in paths:
        try:
            sources = open_sources(path)
        except DataError as e:
            if "qwenkit[" in str(e):
                problems.append(str(e))
            continue  # any other problem of the data is the ranks' to report, row by row
        if qconfig.installed("av"):
            continue
        for source in sources:
            try:
                rows = len(source)
            except ValueError:  # a malformed file: the ranks report it
                continue
            if any(_has_videos(source, i, cfg.data.layout) for i in range(rows)):
                problems.append(f"data: {source.name} has video rows; reading them needs PyAV (FFmpeg bindings), "
                                "which is not installed: pip install 'qwenkit[video]'")  # fmt: skip
                break
    return problems


def _has_videos(source, i: int, layout: str) -> bool:
    try:
        return bool(parse_row(source.row(i), source.location(i), layout).videos)
    except ValueError:  # a bad row: data.on_bad_sample decides in the ranks
        return False


def check_module_paths(cfg) -> list[str]:
    """``parallel.shard_patterns``, ``parallel.recompute``, ``model.freeze``, the LoRA targets and
    saved modules and the ``train.param_groups`` patterns against the model's module tree, built
    on the meta device from the checkpoint's ``config.json``: no weights are read and no memory
    is taken (about a second for a 7B model), where the ranks would find the same mistake only
    after loading the weights, with ``config.yaml`` and ``logs/`` already written."""
    try:
        model = registry.build(dataclasses.replace(cfg.model, init_device="meta", freeze=[]))
    except (ValueError, OSError) as e:
        return [str(e)]
    problems = []
    for key in ("shard_patterns", "recompute"):  # auto: the family's units
        for pattern in families.units(model, key, getattr(cfg.parallel, key)):
            try:
                fsdp.match_modules(model, [pattern], f"parallel.{key}")  # the rule fully_shard and the recompute wrappers use
            except ValueError as e:
                problems.append(str(e))
    for path in cfg.model.freeze:
        try:
            registry.freeze(model, [path])  # the meta copy is thrown away: freezing it changes nothing
        except ValueError as e:
            problems.append(str(e))
    return problems + lora.problems(model, cfg.lora) + optim.group_problems(model, cfg.train)


def rank_count_problem(parallel) -> str | None:
    """More ranks than this node's accelerators fail in the ranks; more CPU ranks than cores swap
    the machine to a halt (each rank holds a model copy and its threads): refused before spawning."""
    try:
        device = resolve_device(parallel.device)
    except ValueError as e:
        return str(e)
    n, have = parallel.nproc, device_count(device)
    if device != "cpu" and n > have:
        return f"parallel.nproc={n} ranks on {device}, but this node sees {have} {device} device(s); use --nproc {have} or fewer"
    if device == "cpu" and n > have and not parallel.allow_oversubscribe:
        return (
            f"parallel.nproc={n} CPU ranks, but this process may use {have} core(s); use --nproc {have} or fewer, "
            "or set parallel.allow_oversubscribe=true to run them anyway"
        )
    return None


def check_resume(cfg, world_size: int | None = None) -> list[str]:
    """The resume rule (:func:`qwenkit.engine.resume.decide`) before any process starts: the
    checkpoint ``train.resume`` names exists, is whole (files and sizes as recorded; the ranks
    verify the checksums), fits this run of ``world_size`` ranks, and newer ones would not be
    written over. With ``resume: auto`` a damaged newest checkpoint is skipped, saying so."""
    try:
        decision = resume_rule.decide(cfg, world_size)
    except resume_rule.CheckpointError as e:
        return [str(e)]
    for _, problem in decision.skipped:
        print(f"qwenkit train: train.resume=auto: {problem}; resuming from {decision.path or 'scratch'} instead",
              file=sys.stderr)  # fmt: skip
    return []


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
        "-m", "qwenkit.engine.rank", "--config", str(config_path),
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
    """In torchrun's process before exec: its own process group, and SIGTERM when we die."""
    os.setpgid(0, 0)
    stopping.set_parent_death_signal(signal.SIGTERM)


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


def _cleanly(what: str, fn, *args):
    """``fn(*args)``, or None after one line naming what could not be written and why."""
    try:
        return fn(*args)
    except OSError as e:
        print(f"qwenkit train: cannot write {what}: {e.strerror or e} ({getattr(e, 'filename', None) or what})", file=sys.stderr)
        return None


def launch(
    config: str | None, overrides: list[str], nproc: int | None = None, rdzv: Rendezvous = Rendezvous(),
    said: str | None = None,
) -> int:
    """``qwenkit train``: ``config`` (a params YAML or None for the defaults) with dotted
    ``overrides``; ``nproc`` overrides ``parallel.nproc``; ``said``: where ``rdzv`` was found
    (logged once, with the rendezvous the config settles). Returns the exit status."""
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
            refused(cfg, f"qwenkit train: {e}")
        return 2
    if rdzv.backend == "c10d":
        said = (f"{said}; " if said else "") + (
            f"c10d rendezvous {rdzv.rdzv_id!r} at {rdzv.master_addr}:{rendezvous_port(rdzv)}, "
            f"{rdzv.nodes} node(s), {rdzv.max_restarts} restart(s)"
        )
    if said:
        print(f"qwenkit train: {said}", file=sys.stderr, flush=True)
    if rdzv.backend == "static" and not 0 <= rdzv.node_rank < rdzv.nnodes:
        line = f"qwenkit train: --node-rank must be in [0, --nnodes={rdzv.nnodes}), got {rdzv.node_rank}"
        print(line, file=sys.stderr)
        return refused(cfg, line)
    # model.init_from: the run it starts from, trained first when missing, exported once
    stopped = init_from.prepare(cfg, lambda recipe, extra: launch(recipe, extra, nproc, rdzv))
    if stopped is not None:
        return refused(cfg, f"qwenkit train: model.init_from={cfg.model.init_from!r}: the run to start from is not "
                       f"ready (exit {stopped}; the lines above say why)", stopped)  # fmt: skip
    out = Path(cfg.train.output_dir)
    node = node_name(rdzv)
    lock = None
    try:
        if out.is_dir():  # a job there now: say so before anything else
            lock = acquire_lock(out, node)
        problems = check_before_spawn(cfg, rdzv)
        if problems:
            print("qwenkit train: invalid run:\n  - " + "\n  - ".join(problems), file=sys.stderr)
            return refused(cfg, "qwenkit train: invalid run: " + "; ".join(problems), message=problems[0])
        if lock is None:
            lock = _cleanly(str(lock_path(out, node)), acquire_lock, out, node)
            if lock is None and not out.is_dir():
                return 2
        return _launch_locked(cfg, rdzv, lock)
    except OutputDirBusy as e:
        print_user_error("train", e)  # no event: the folder's stream is the live job's
        return 2
    finally:
        if lock is not None:
            os.close(lock)  # torchrun's copy is closed with torchrun: the lock is free now


def refused(cfg, summary: str, code: int = 2, message: str | None = None) -> int:
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
    if _cleanly(str(run.config), qconfig.write_config, cfg, out) is None:
        return refused(cfg, f"qwenkit train: cannot write {run.config}")
    # the ranks read a copy only this launcher wrote (config.yaml is for export and for people)
    rank_config = out / f".config-{socket.gethostname()}-{os.getpid()}.yaml"
    if _cleanly(str(rank_config), shutil.copyfile, run.config, rank_config) is None:
        return refused(cfg, f"qwenkit train: cannot write {rank_config}")
    since = events.Follower(out)  # this job's events: torchrun's wrapper or a rank may record the failure
    try:
        cmd = torchrun_command(rank_config, cfg.parallel.nproc, rdzv, events_dir=out)
        print(f"qwenkit train: {shlex.join(cmd)}", flush=True)
        code = spawn(cmd, rank_environment(cfg, os.environ), pass_fds=() if lock is None else (lock,))
    finally:
        rank_config.unlink(missing_ok=True)
    since.poll()
    if code not in (0, stopping.EXIT_RESUMABLE) and not events.failed(since.seen):
        torchrun_ended(out, code)
    logs = run.logs
    if code == stopping.EXIT_RESUMABLE:
        print(f"qwenkit train: stopped with a checkpoint saved before train.steps={cfg.train.steps} "
              f"(exit {code}, see {run.rank_log(0)}): run the same command again to continue", file=sys.stderr)  # fmt: skip
    elif code != 0:
        print(
            f"qwenkit train: failed with exit code {code}; the rank that failed first is named above "
            f"(its own error in its 'qwenkit train: rank N failed' line), every rank's log is in {logs}/",
            file=sys.stderr,
        )
    return code
