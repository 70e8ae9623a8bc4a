"""Where this node sits in a job, read from the scheduler that started it, and the rendezvous port.

``qwenkit train`` with no ``--nnodes/--node-rank/--master-addr/--master-port/--nproc`` finds
them in the environment of

- **Slurm** (one ``srun`` task per node): ``SLURM_NNODES`` (``SLURM_STEP_NUM_NODES`` in a step),
  ``SLURM_NODEID``, the first host of ``SLURM_JOB_NODELIST`` (``SLURM_STEP_NODELIST``; the
  compressed form ``node[01-04,07]`` is expanded here, no ``scontrol`` needed), the port
  ``MASTER_PORT`` or one derived from ``SLURM_JOB_ID`` (the same on every node, different for
  two jobs that share a node), and ``SLURM_GPUS_ON_NODE`` processes per node;
- the **Kubeflow PyTorchJob** operator: ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE``,
  ``MASTER_ADDR``, ``MASTER_PORT``; its ``WORLD_SIZE`` must count pods or processes and, counting
  pods, its ``RANK`` is the pod's index;
- **PAI-DLC** (and any launcher that says ``MASTER_ADDR``, ``WORLD_SIZE`` = nodes, ``RANK`` = node).

A flag wins over the environment for the address, the port and the processes per node; for the
number of nodes and this node's rank the scheduler started the launchers, so a flag that says
otherwise is refused, naming what was found where (:class:`ClusterError`, before any process
starts).

torchrun's rendezvous (:func:`settle`, once the config is read): ``static`` (every node is told
its rank) or ``c10d`` (torchrun's elastic rendezvous, hosted at the master's address and port:
nodes take ranks as they join, ``--nnodes MIN:MAX`` lets the job run on fewer nodes, and
``parallel.max_restarts`` restarts the whole group after a rank fails). ``parallel.rendezvous:
auto`` takes c10d when the scheduler asks for it (a PyTorchJob's ``elasticPolicy`` sets
``PET_RDZV_BACKEND``, ``PET_RDZV_ENDPOINT``, ``PET_RDZV_ID``, ``PET_MAX_RESTARTS`` and an
``N`` or ``MIN:MAX`` ``PET_NNODES``), for a range of nodes or for restarts; static otherwise.
Standard library only: the test harness that starts ranks imports this module too.
"""

from __future__ import annotations

import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

MULTINODE_PORT = 6000  # every node must be given the same port; this is the one they agree on by default
SLURM_PORT_BASE = 20000  # Slurm: MASTER_PORT, else this + SLURM_JOB_ID % 20000


class ClusterError(ValueError):
    """The scheduler's environment contradicts itself or a flag: one line naming both."""


@dataclass(frozen=True)
class Rendezvous:
    """Where this node sits among the nodes of a job, and how torchrun's rendezvous finds them."""

    nnodes: int = 1  # c10d: the fewest nodes the job runs on (MIN of MIN:MAX)
    node_rank: int = 0  # static only: c10d numbers the nodes as they join
    master_addr: str = "127.0.0.1"  # static: node 0; c10d: the host of the rendezvous store
    master_port: int | None = None  # None: a free port on one node, MULTINODE_PORT across nodes
    max_nnodes: int | None = None  # c10d: MAX of MIN:MAX (None: nnodes)
    backend: str = "static"  # static | c10d (the scheduler's until settle() applies parallel.rendezvous)
    rdzv_id: str = ""  # c10d: the job's id, the same on every node (the scheduler's, or parallel.rdzv_id)
    max_restarts: int = 0  # group restarts after a failure (the scheduler's, or parallel.max_restarts)
    said: str = ""  # where backend / max_restarts came from, for an error that names it

    @property
    def nodes(self) -> str:
        """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX``."""
        top = self.max_nnodes or self.nnodes
        return str(self.nnodes) if top == self.nnodes else f"{self.nnodes}:{top}"

    @property
    def most_nodes(self) -> int:
        return self.max_nnodes or self.nnodes


def parse_nnodes(text: str, where: str = "--nnodes") -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (torchrun's ``--nnodes``) as ``(min, max)``; 1 <= MIN <= MAX."""
    lo, colon, hi = str(text).partition(":")
    if not lo.isdigit() or (colon and not hi.isdigit()) or int(lo) < 1 or (colon and int(hi) < int(lo)):
        raise ClusterError(f"{where}={text!r} must be a number of nodes N or a range MIN:MAX with 1 <= MIN <= MAX")
    return int(lo), int(hi) if colon else int(lo)


@dataclass
class Found:
    """What a scheduler's environment says; ``where`` names the variable behind each value."""

    scheduler: str
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None = None
    nproc: int | None = None
    where: dict[str, str] = field(default_factory=dict)
    max_nnodes: int | None = None
    backend: str = "static"
    rdzv_id: str = ""
    max_restarts: int = 0
    said: str = ""  # the variables behind backend / max_restarts


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list in order: ``a1,b[2-3,07]`` -> ``[a1, b2, b3, b07]`` (zero
    padding kept: ``[01-03]`` -> 01, 02, 03)."""
    hosts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            if text[start:i]:
                hosts.extend(_expand_host(text[start:i]))
            start = i + 1
    return hosts


def _expand_host(pattern: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", pattern)
    if m is None:
        return [pattern]
    prefix, ranges, rest = m.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ClusterError(f"SLURM nodelist {pattern!r}: {part!r} is not a number or a range of numbers")
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(prefix + str(n).zfill(len(lo)) + tail for tail in _expand_host(rest) or [""])
    return out


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ClusterError(f"{name}={env[name]!r} is not a whole number") from None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    return next((n for n in names if env.get(n)), None)


def from_environment(env: Mapping[str, str]) -> Found | None:
    """What the scheduler that started this process says, or None outside one."""
    if env.get("SLURM_JOB_ID") and _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        return _slurm(env)
    if env.get("PET_NNODES"):
        return _pytorchjob(env)
    if all(env.get(n) for n in ("MASTER_ADDR", "WORLD_SIZE", "RANK")) and not env.get("LOCAL_RANK"):
        return _world_of_nodes(env)
    return None


def _slurm(env: Mapping[str, str]) -> Found:
    count = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    listed = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if listed is None:
        raise ClusterError(f"Slurm job {env['SLURM_JOB_ID']} without SLURM_JOB_NODELIST: cannot find node 0")
    nodes, nnodes = expand_nodelist(env[listed]), _int(env, count)
    if len(nodes) != nnodes:
        raise ClusterError(f"{count}={nnodes} but {listed}={env[listed]!r} names {len(nodes)} host(s)")
    tasks = _first(env, "SLURM_STEP_NUM_TASKS")
    if tasks and _int(env, tasks) != nnodes:
        raise ClusterError(f"{tasks}={env[tasks]} launchers on {count}={nnodes} nodes: qwenkit train starts the ranks "
                           "of its node itself, run one per node (srun --ntasks-per-node=1)")  # fmt: skip
    found = Found("Slurm", nnodes, _int(env, "SLURM_NODEID") if env.get("SLURM_NODEID") else 0, nodes[0])
    found.where = {"nnodes": f"{count}={nnodes}", "node_rank": f"SLURM_NODEID={found.node_rank}",
                   "master_addr": f"the first host of {listed}={env[listed]}"}  # fmt: skip
    if env.get("MASTER_PORT"):
        found.master_port, found.where["master_port"] = _int(env, "MASTER_PORT"), f"MASTER_PORT={env['MASTER_PORT']}"
    else:
        found.master_port = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % 20000
        found.where["master_port"] = f"from SLURM_JOB_ID={env['SLURM_JOB_ID']}"
    gpus = env.get("SLURM_GPUS_ON_NODE", "")
    if gpus.isdigit() and int(gpus) > 0:
        found.nproc, found.where["nproc"] = int(gpus), f"SLURM_GPUS_ON_NODE={gpus}"
    found.rdzv_id = f"slurm-{env['SLURM_JOB_ID']}"  # a c10d rendezvous's id: one per job, shared by its nodes
    return found


def _pytorchjob(env: Mapping[str, str]) -> Found:
    nnodes_text = env["PET_NNODES"]
    lo, hi = parse_nnodes(nnodes_text, "PET_NNODES")
    backend = env.get("PET_RDZV_BACKEND", "")
    if backend not in ("", "static", "c10d"):
        raise ClusterError(f"PET_RDZV_BACKEND={backend}: qwenkit train supports the c10d rendezvous "
                           "(elasticPolicy.rdzvBackend: c10d)")  # fmt: skip
    endpoint = env.get("PET_RDZV_ENDPOINT", "") if backend == "c10d" else ""
    addr = _first(env, "PET_MASTER_ADDR", "MASTER_ADDR")
    if endpoint:  # an elasticPolicy: the rendezvous store's host:port (worker 0's service); no node ranks
        host, _, port_text = endpoint.rpartition(":")
        if not host or not port_text.isdigit():
            raise ClusterError(f"PET_RDZV_ENDPOINT={endpoint!r} is not host:port")
        found = Found("PyTorchJob", lo, 0, host, int(port_text), max_nnodes=hi if hi != lo else None)
        found.where = {"nnodes": f"PET_NNODES={nnodes_text}", "node_rank": "the c10d rendezvous's",
                       "master_addr": f"PET_RDZV_ENDPOINT={endpoint}", "master_port": f"PET_RDZV_ENDPOINT={endpoint}"}  # fmt: skip
        found.backend, found.rdzv_id, found.said = "c10d", env.get("PET_RDZV_ID", ""), f"PET_RDZV_BACKEND={backend}"
        if env.get("PET_MAX_RESTARTS"):
            found.max_restarts = _int(env, "PET_MAX_RESTARTS")
            found.said += f", PET_MAX_RESTARTS={found.max_restarts}"
        per_node = env.get("PET_NPROC_PER_NODE", "")
        if per_node.isdigit():
            found.nproc, found.where["nproc"] = int(per_node), f"PET_NPROC_PER_NODE={per_node}"
        return found
    if hi != lo:
        raise ClusterError(f"PET_NNODES={nnodes_text} asks for an elastic job (MIN:MAX nodes) without a c10d "
                           "rendezvous: give the PyTorchJob an elasticPolicy with rdzvBackend: c10d")  # fmt: skip
    if addr is None:
        raise ClusterError(f"PET_NNODES={nnodes_text} without MASTER_ADDR: cannot find the master pod")
    rank_var = _first(env, "PET_NODE_RANK", "RANK") or "PET_NODE_RANK"
    found = Found("PyTorchJob", lo, _int(env, rank_var) if env.get(rank_var) else 0, env[addr])
    found.where = {"nnodes": f"PET_NNODES={nnodes_text}", "node_rank": f"{rank_var}={found.node_rank}",
                   "master_addr": f"{addr}={env[addr]}"}  # fmt: skip
    port = _first(env, "PET_MASTER_PORT", "MASTER_PORT")
    if port:
        found.master_port, found.where["master_port"] = _int(env, port), f"{port}={env[port]}"
    per_node = env.get("PET_NPROC_PER_NODE", "")
    if per_node.isdigit():
        found.nproc, found.where["nproc"] = int(per_node), f"PET_NPROC_PER_NODE={per_node}"
    if env.get("WORLD_SIZE"):
        world = _int(env, "WORLD_SIZE")
        counts = {found.nnodes: "pods"} | ({found.nnodes * found.nproc: "processes"} if found.nproc else {})
        if world not in counts:
            raise ClusterError(f"WORLD_SIZE={world} is neither the pods (PET_NNODES={found.nnodes}) nor the processes "
                               f"(x PET_NPROC_PER_NODE={per_node or '?'}) of this PyTorchJob")  # fmt: skip
        if counts[world] == "pods" and env.get("RANK") and _int(env, "RANK") != found.node_rank:
            raise ClusterError(f"RANK={env['RANK']} (the pod's index) but {found.where['node_rank']}")
    return found


def _world_of_nodes(env: Mapping[str, str]) -> Found:
    found = Found("PAI-DLC", _int(env, "WORLD_SIZE"), _int(env, "RANK"), env["MASTER_ADDR"])
    found.where = {"nnodes": f"WORLD_SIZE={env['WORLD_SIZE']}", "node_rank": f"RANK={env['RANK']}",
                   "master_addr": f"MASTER_ADDR={env['MASTER_ADDR']}"}  # fmt: skip
    if env.get("MASTER_PORT"):
        found.master_port, found.where["master_port"] = _int(env, "MASTER_PORT"), f"MASTER_PORT={env['MASTER_PORT']}"
    return found


FLAGS = {"nnodes": "--nnodes", "node_rank": "--node-rank", "master_addr": "--master-addr",
         "master_port": "--master-port", "nproc": "--nproc"}  # fmt: skip


def resolve(flags: Mapping[str, object], env: Mapping[str, str]) -> tuple[Rendezvous, int | None, str | None]:
    """The rendezvous from ``flags`` (``FLAGS``' keys, None where not given; ``nnodes`` ``N`` or
    ``MIN:MAX``) and the scheduler's environment; returns it, the processes per node (None:
    ``parallel.nproc``) and one line saying what was found where (None outside a scheduler with
    no multi-node flags)."""
    found = from_environment(env)
    given = {k: v for k, v in flags.items() if v is not None}
    span = parse_nnodes(str(given.pop("nnodes"))) if "nnodes" in given else None
    if span is not None:
        given["nnodes"] = span[0]
    top = {"max_nnodes": span[1]} if span is not None and span[1] != span[0] else {}
    if found is None:
        rdzv = Rendezvous(**{k: v for k, v in given.items() if k != "nproc"}, **top)
        said = (f"rendezvous: {rdzv.nodes} nodes, this one {rdzv.node_rank}, master {rdzv.master_addr}"
                if rdzv.most_nodes > 1 else None)  # fmt: skip
        return rdzv, given.get("nproc"), said
    if span is not None and span != (found.nnodes, found.max_nnodes or found.nnodes):
        raise ClusterError(f"--nnodes {flags['nnodes']} contradicts {found.scheduler}: {found.where['nnodes']}; "
                           "drop --nnodes (the scheduler started one launcher per node)")  # fmt: skip
    if "node_rank" in given and given["node_rank"] != found.node_rank:
        raise ClusterError(f"--node-rank {given['node_rank']} contradicts {found.scheduler}: {found.where['node_rank']}; "
                           "drop --node-rank (the scheduler started one launcher per node)")  # fmt: skip
    values, said = {}, []
    for key in FLAGS:
        if key in given:
            values[key], source = given[key], FLAGS[key]
        else:
            values[key], source = getattr(found, key), found.where.get(key)
        if values[key] is not None and not (key == "node_rank" and found.backend == "c10d"):
            shown = Rendezvous(found.nnodes, max_nnodes=found.max_nnodes).nodes if key == "nnodes" else values[key]
            said.append(f"{key}={shown} ({source})")
    nproc = values.pop("nproc")
    rdzv = Rendezvous(**values, max_nnodes=found.max_nnodes, backend=found.backend, rdzv_id=found.rdzv_id,
                      max_restarts=found.max_restarts, said=found.said)  # fmt: skip
    if found.backend == "static" and not 0 <= rdzv.node_rank < rdzv.nnodes:
        raise ClusterError(f"node rank {rdzv.node_rank} outside [0, {rdzv.nnodes}): {', '.join(said)}")
    if found.said:
        said.append(found.said)
    return rdzv, nproc, f"rendezvous from {found.scheduler}: " + ", ".join(said)


def settle(rdzv: Rendezvous, parallel) -> Rendezvous:
    """The rendezvous torchrun is given, once the config is read: ``parallel.rendezvous`` (``auto``:
    c10d when the scheduler asks for it, for a MIN:MAX range of nodes or for restarts),
    ``parallel.rdzv_id`` and ``parallel.max_restarts`` (the config's, else the scheduler's).
    :class:`ClusterError` for a combination torchrun could not run as asked."""
    restarts = parallel.max_restarts or rdzv.max_restarts
    elastic = rdzv.most_nodes != rdzv.nnodes
    backend = parallel.rendezvous
    if backend == "auto":
        backend = "c10d" if rdzv.backend == "c10d" or elastic or restarts > 0 else "static"
    if backend == "static":
        if rdzv.backend == "c10d":
            raise ClusterError(f"parallel.rendezvous=static, but the scheduler set a c10d rendezvous ({rdzv.said}): "
                               "set parallel.rendezvous=c10d (or auto)")  # fmt: skip
        if elastic:
            raise ClusterError(f"--nnodes {rdzv.nodes} is a range of nodes: it needs parallel.rendezvous=c10d (or auto); "
                               "a static rendezvous has a fixed number")  # fmt: skip
        if restarts:
            raise ClusterError(f"max_restarts={restarts} ({rdzv.said or 'parallel.max_restarts'}) needs "
                               "parallel.rendezvous=c10d (or auto): a static rendezvous cannot regroup the nodes")  # fmt: skip
        return Rendezvous(rdzv.nnodes, rdzv.node_rank, rdzv.master_addr, rdzv.master_port)
    rdzv_id = parallel.rdzv_id or rdzv.rdzv_id
    if not rdzv_id:
        if rdzv.most_nodes > 1:
            raise ClusterError(f"parallel.rendezvous=c10d on {rdzv.nodes} nodes needs parallel.rdzv_id (one id, the "
                               "same on every node of the job; Slurm's job id and a PyTorchJob's rdzvId are used when set)")  # fmt: skip
        rdzv_id = f"qwenkit-{uuid.uuid4().hex[:12]}"  # one node: nobody else to agree with
    return Rendezvous(rdzv.nnodes, 0, rdzv.master_addr, rdzv.master_port, rdzv.max_nnodes, "c10d", rdzv_id, restarts, rdzv.said)
