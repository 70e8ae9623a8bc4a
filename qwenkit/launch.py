"""``qwenkit train``: validate the config, write it to the run's output_dir, and start torchrun.

One path for every size: even ``--nproc 1`` runs under torchrun, so a rank always sees the same
environment. The config is loaded and checked (keys, types, ranges, the model directory, the
dataset path) *before* any process starts; the resolved YAML written to
``<output_dir>/config.yaml`` is what every rank reads and what ``qwenkit export`` finds later.

Multi-node: run the same command on every node with ``--nnodes N --node-rank i
--master-addr <node 0's address>`` (default port 6000; on one node a free port, so concurrent
jobs on one machine never collide). The exit status is torchrun's: non-zero
when any rank fails (torchrun then stops the others and prints the failing rank's error).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from qwenkit import config as qconfig
from qwenkit.device import CPU_MALLOC_ENV, device_count, resolve_device
from qwenkit.distributed import fsdp
from qwenkit.engine import checkpoint as ckpt
from qwenkit.model import registry
from qwenkit.model.paths import resolve_path


@dataclass(frozen=True)
class Rendezvous:
    """Where this node sits among the nodes of a job (torchrun's static rendezvous)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port on one node, MULTINODE_PORT across nodes


MULTINODE_PORT = 6000  # every node must be given the same port; this is the one they agree on by default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rendezvous_port(rdzv: Rendezvous) -> int:
    if rdzv.master_port is not None:
        return rdzv.master_port
    return free_port(rdzv.master_addr) if rdzv.nnodes == 1 else MULTINODE_PORT


def check_before_spawn(cfg) -> list[str]:
    """Problems that would otherwise surface only inside every rank; empty when all is well."""
    problems = []
    try:
        resolve_path(cfg.model)  # writes the tiny checkpoint once, before ranks race for it
    except FileNotFoundError as e:
        problems.append(str(e))
    else:
        problems.extend(check_module_paths(cfg))
    if cfg.data.path != "tiny" and not Path(cfg.data.path).expanduser().exists():
        problems.append(f"data.path={cfg.data.path!r} does not exist")
    problems.extend(check_resume(cfg))
    ranks = check_ranks(cfg.parallel)
    if ranks:
        problems.append(ranks)
    hsdp = fsdp.hsdp_problem(cfg.parallel)
    if hsdp:
        problems.append(hsdp)
    return problems


def check_module_paths(cfg) -> list[str]:
    """``parallel.shard_patterns``, ``parallel.recompute`` and ``model.freeze`` against the model's
    module tree, built on the meta device from the checkpoint's ``config.json``: no weights are
    read and no memory is taken (about a second for a 7B model), where the ranks would find the same
    mistake only after loading the weights, with ``config.yaml`` and ``logs/`` already written."""
    try:
        model = registry.build(dataclasses.replace(cfg.model, init_device="meta", freeze=[]))
    except (ValueError, OSError) as e:
        return [str(e)]
    problems = []
    for key in ("parallel.shard_patterns", "parallel.recompute"):
        for pattern in getattr(cfg.parallel, key.split(".")[1]):
            try:
                fsdp.match_modules(model, [pattern], key)  # the rule fully_shard and the recompute wrappers use
            except ValueError as e:
                problems.append(str(e))
    for path in cfg.model.freeze:
        try:
            registry.freeze(model, [path])  # the meta copy is thrown away: freezing it changes nothing
        except ValueError as e:
            problems.append(str(e))
    return problems


def check_ranks(parallel) -> str | None:
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


def check_resume(cfg) -> list[str]:
    """The checkpoint ``train.resume`` names exists; newer ones would not be written over."""
    try:
        resume = ckpt.find_resume(cfg.train.resume, cfg.train.output_dir)
    except ckpt.CheckpointError as e:
        return [str(e)]
    problem = ckpt.refuse_older_resume(resume, cfg.train.output_dir)
    return [problem] if problem and not cfg.train.resume_older else []


def rank_environment(cfg, base: dict[str, str]) -> dict[str, str]:
    """The ranks' environment: ``base`` plus the CPU allocator setting when ranks run on CPU."""
    env = dict(base)
    device = cfg.parallel.device
    if device == "cpu" or (device == "auto" and resolve_device("auto") == "cpu"):
        for key, value in CPU_MALLOC_ENV.items():
            env.setdefault(key, value)
    return env


def torchrun_command(config_path: Path, nproc: int, rdzv: Rendezvous) -> list[str]:
    """torchrun's command line, run through :func:`qwenkit.torchrun.quiet_torchrun`."""
    return [
        sys.executable, "-m", "qwenkit.torchrun",
        f"--nnodes={rdzv.nnodes}",
        f"--nproc-per-node={nproc}",
        f"--node-rank={rdzv.node_rank}",
        f"--master-addr={rdzv.master_addr}",
        f"--master-port={rendezvous_port(rdzv)}",
        "-m", "qwenkit.engine.train", "--config", str(config_path),
    ]  # fmt: skip


def launch(
    config: str | None, overrides: list[str], nproc: int | None = None, rdzv: Rendezvous = Rendezvous()
) -> int:
    """``qwenkit train``: ``config`` (a params YAML or None for the defaults) with dotted
    ``overrides``; ``nproc`` overrides ``parallel.nproc``. Returns the exit status."""
    overrides = list(overrides)
    if nproc is not None:
        overrides.append(f"parallel.nproc={nproc}")
    try:
        cfg = qconfig.load(config, overrides)
    except qconfig.ConfigError as e:
        print(f"qwenkit train: {e}", file=sys.stderr)
        return 2
    if not 0 <= rdzv.node_rank < rdzv.nnodes:
        print(f"qwenkit train: --node-rank must be in [0, --nnodes={rdzv.nnodes}), got {rdzv.node_rank}", file=sys.stderr)
        return 2
    problems = check_before_spawn(cfg)
    if problems:
        print("qwenkit train: invalid run:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    config_path = qconfig.write_config(cfg, cfg.train.output_dir)
    cmd = torchrun_command(config_path, cfg.parallel.nproc, rdzv)
    print(f"qwenkit train: {shlex.join(cmd)}", flush=True)
    code = subprocess.call(cmd, env=rank_environment(cfg, os.environ))
    if code != 0:
        logs = Path(cfg.train.output_dir) / "logs"
        print(
            f"qwenkit train: failed with exit code {code}; the failing rank's error is above "
            f"(its 'qwenkit train: rank N failed' line), every rank's log is in {logs}/",
            file=sys.stderr,
        )
    return code
