"""FSDP2 shard plan: the process's place in the job, ``fully_shard`` by module pattern, recompute,
activation offload, and meta-device materialisation.

The distributed engine is PyTorch's own; this module only decides *what* to hand to it:

1. :func:`init_distributed` joins the process group torchrun set up (or makes a one-process
   group), picks the device (``cpu``/gloo, ``cuda``/nccl, ``npu``/hccl) and :func:`build_mesh`
   makes a 1-D mesh, or a 2-D HSDP mesh ``(replicas, world // replicas)`` for multi-node runs.
2. :func:`apply_recompute` wraps the modules matching ``parallel.recompute`` in PyTorch's
   non-reentrant ``checkpoint_wrapper`` (recompute happens inside the FSDP unit, so the gathered
   weights are the ones FSDP already holds for backward).
3. :func:`shard` calls ``fully_shard`` on every module matching ``parallel.shard_patterns``,
   deepest first, then on the root. A module holding a weight that is shared with a module
   outside it (Qwen2.5-VL-3B ties ``lm_head`` to ``embed_tokens``) is left to the root, so a tied
   weight lives in exactly one FSDP group. With expert parallelism (:mod:`qwenkit.distributed.expert`)
   the experts modules come first, each sharded over the ``efsdp`` dimension of the expert mesh.
   :func:`gradient_excess` then asks FSDP, on a
   throwaway module, whether its reduction really averages over the ranks; where the backend sums
   instead (torch 2.7's gloo), every group divides its reduced gradients by the difference.

Patterns are dotted module paths in which ``*`` matches exactly one path segment:
``model.language_model.layers.*`` matches ``model.language_model.layers.7`` but not
``model.language_model.layers.7.mlp``. A pattern that matches nothing is an error.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Shard

from qwenkit.config import DTYPES
from qwenkit.device import resolve_device
from qwenkit.distributed.meta import build_on_meta, set_buffer, tied_groups
from qwenkit.model.families import registry as families
from qwenkit.model.modules import module_path, path_match

if TYPE_CHECKING:
    from qwenkit.distributed.expert import ExpertGroups

log = logging.getLogger(__name__)
DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


# ---------------------------------------------------------------------------------------------
# Process group, device, mesh


@dataclass
class Runtime:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    owns_group: bool  # this process created the process group, so it also destroys it


def init_distributed(parallel_cfg) -> Runtime:
    """Join torchrun's process group (env ``RANK``/``WORLD_SIZE``), or make a one-process group.

    A group that already exists (a test running several trainings in one process group) is used
    as is and left alone at the end.
    """
    device_type = resolve_device(parallel_cfg.device)
    backend = DIST_BACKENDS[device_type] if parallel_cfg.backend == "auto" else parallel_cfg.backend
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(device_type, local_rank)
        torch.get_device_module(device_type).set_device(device)
    owns = not dist.is_initialized()
    if owns:
        timeout = datetime.timedelta(seconds=parallel_cfg.timeout_s)  # every collective; see parallel.timeout_s
        if "RANK" in os.environ:
            # device_id: NCCL binds the communicator to this rank's GPU up front
            dist.init_process_group(backend, timeout=timeout, device_id=device if device_type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, owns)


def shutdown(runtime: Runtime) -> None:
    """Leave the job: a barrier (every rank is done with the group), then destroy it."""
    if runtime.owns_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a rank with ``code``: flush the logs and streams, then leave without interpreter teardown.

    Why not ``sys.exit``: destroying a gloo group does not stop it (gloo's backend has no
    ``shutdown``; ``destroy_process_group`` only forgets the group), so its worker threads
    (``pt_gloo_runloop``) and socket thread (``gloo_tcp_loop``) run on for as long as anything
    still holds the group: the model's FSDP state, a ``DeviceMesh``. A rank that raised never
    destroyed it at all, and its heartbeat thread may sit in a store call with the GIL released.
    At ``sys.exit`` CPython tears the interpreter down and then the C++ statics around those live
    threads, while the peers exit and close their sockets: in some interleavings (seen under load,
    rank 1 after its work was done) that ends in ``std::terminate`` -- "terminate called without
    an active exception", SIGABRT, exit 134 in place of the rank's own status. Nothing a rank
    needs happens at interpreter teardown (metrics, checkpoints and trackers are closed by the
    trainer), so it is skipped: the process ends here, with its own code, every time.
    """
    logging.shutdown()  # the rank's log file handler
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say
            pass
    os._exit(code)


def hsdp_problem(parallel_cfg) -> str | None:
    """Why HSDP cannot run with this backend and torch, or None.

    FSDP2 in torch 2.7 all-reduces HSDP's replicate dimension with ``ReduceOp.AVG``, which gloo
    does not have (seen on 2.7.1: ``Cannot use ReduceOp.AVG with Gloo``; 2.13 works). NCCL and
    HCCL have AVG.
    """
    if parallel_cfg.hsdp_replicas <= 1:
        return None
    backend = parallel_cfg.backend
    if backend == "auto":
        backend = DIST_BACKENDS[resolve_device(parallel_cfg.device)]
    major, minor = (int(x) for x in str(torch.__version__).split("+")[0].split(".")[:2])
    if backend == "gloo" and (major, minor) < (2, 8):
        return (
            f"parallel.hsdp_replicas={parallel_cfg.hsdp_replicas} on gloo needs torch >= 2.8 (torch "
            f"{torch.__version__}'s FSDP2 averages the replicas with ReduceOp.AVG, which gloo lacks); "
            "use parallel.hsdp_replicas=1 on CPU, or run HSDP on NCCL/HCCL"
        )
    return None


def build_mesh(runtime: Runtime, hsdp_replicas: int = 1) -> DeviceMesh:
    """1-D FSDP mesh, or 2-D HSDP mesh: replicate across ``hsdp_replicas``, shard within each."""
    world, r = runtime.world_size, hsdp_replicas
    if world % r:
        raise ValueError(f"parallel.hsdp_replicas={r} must divide the world size {world}")
    if r == 1:
        return init_device_mesh(runtime.device.type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(runtime.device.type, (r, world // r), mesh_dim_names=("replicate", "shard"))


# ---------------------------------------------------------------------------------------------
# Module patterns


def match_modules(model: nn.Module, patterns: list[str], key: str) -> list[tuple[str, nn.Module]]:
    """Modules whose dotted path matches one of ``patterns`` (``*`` = one segment), in model order.

    ``key`` names the config field in the error raised for a pattern that matches nothing.
    """
    # A checkpoint_wrapper and the module inside it share one path; the wrapper stands for both.
    names = [(n, m) for n, m in model.named_modules() if n and not n.endswith("._checkpoint_wrapped_module")]
    found: dict[str, nn.Module] = {}
    for pattern in patterns:
        hits = [(n, m) for n, m in names if path_match(module_path(n), pattern)]
        if not hits:
            raise ValueError(f"{key}: pattern {pattern!r} matches no module of {type(model).__name__}")
        found.update(hits)
    order = {n: i for i, (n, _) in enumerate(names)}
    return sorted(found.items(), key=lambda item: order[item[0]])


def apply_recompute(model: nn.Module, patterns: list[str] | str) -> list[str]:
    """Wrap each matching module in non-reentrant activation checkpointing; returns their paths.

    Memory: a wrapped block keeps only its inputs for backward and recomputes the rest, so the
    saved activations of N blocks fall from N x (everything a block saves) to N x (its input).
    """
    patterns = families.units(model, "recompute", patterns)
    if not patterns:
        return []
    wrapped = []
    for name, _module in match_modules(model, patterns, "parallel.recompute"):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, checkpoint_wrapper(getattr(parent, child), checkpoint_impl=CheckpointImpl.NO_REENTRANT))
        wrapped.append(name)
    return wrapped


def activation_offload(enabled: bool, device: torch.device):
    """Context that moves tensors saved for backward to host memory (pinned on accelerators).

    The chunked loss head is exempt: what it saves are its finished gradients (fp32 grad W is
    2.2 GB at 7B), which would travel to host and back every micro-batch for nothing;
    :func:`qwenkit.model.losses.cross_entropy.chunked_linear_cross_entropy` keeps them on the device.
    """
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type != "cpu")


# ---------------------------------------------------------------------------------------------
# fully_shard


@dataclass
class ShardPlan:
    groups: list[str]  # module paths given their own FSDP group, in the order sharded
    left_to_root: dict[str, str] = field(default_factory=dict)  # path -> why it stayed in the root
    recompute: list[str] = field(default_factory=list)
    # >1: the backend summed where FSDP asked it to average; the groups divide by this afterwards
    gradient_divisor: int = 1

    def describe(self) -> str:
        lines = [f"FSDP groups: {len(self.groups)} + root"]
        lines += [f"  left to root: {p} ({why})" for p, why in self.left_to_root.items()]
        if self.gradient_divisor > 1:
            lines.append(
                f"gradient reduction: the backend sums where FSDP averages (torch {torch.__version__}); "
                f"reduced gradients divided by {self.gradient_divisor}"
            )
        if self.recompute:
            lines.append(f"recompute: {len(self.recompute)} modules ({self.recompute[0]} ...)")
        return "\n".join(lines)


def fsdp_kwargs(parallel_cfg, mesh: DeviceMesh) -> dict:
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[parallel_cfg.param_dtype] if parallel_cfg.param_dtype else None,
        reduce_dtype=DTYPES[parallel_cfg.reduce_dtype] if parallel_cfg.reduce_dtype else None,
    )
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if parallel_cfg.cpu_offload else OffloadPolicy()
    return {"mesh": mesh, "mp_policy": mp, "offload_policy": offload}


def shard(model: nn.Module, parallel_cfg, mesh: DeviceMesh, experts: ExpertGroups | None = None,
          ignored: set[nn.Parameter] | None = None) -> ShardPlan:  # fmt: skip
    """``fully_shard`` each module matching ``parallel.shard_patterns`` (deepest first), then the root.

    ``experts`` (expert parallelism): their modules go first, each its own group on the expert
    mesh's ``efsdp`` dimension, its gradients divided by the world size like every other group's
    (an expert's gradient already sums its ``ep`` group's tokens; see :mod:`qwenkit.distributed.expert`).
    ``ignored``: parameters no group takes (tables sharded on their columns, never gathered:
    :mod:`qwenkit.distributed.columns`).
    """
    kwargs = fsdp_kwargs(parallel_cfg, mesh)
    if ignored:
        kwargs["ignored_params"] = ignored
    patterns = families.units(model, "shard_patterns", parallel_cfg.shard_patterns)
    matched = match_modules(model, patterns, "parallel.shard_patterns")
    tied = tied_outside(model, matched)
    plan = ShardPlan(groups=[], left_to_root=tied)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    if experts is not None:  # first: inside the decoder layers
        _shard_experts(experts, parallel_cfg, kwargs, dtype, plan)
    # Children before parents: fully_shard on a parent must see its children already sharded.
    sharded = []
    for name, module in sorted(matched, key=lambda item: -item[0].count(".")):
        if name in tied:
            continue
        fully_shard(module, reshard_after_forward=parallel_cfg.reshard_after_forward, **kwargs)
        plan.groups.append(module_path(name))
        sharded.append(module)
    # The root's parameters are needed again at the start of backward: keep them gathered.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    model.register_forward_hook(_detach_media_outputs, prepend=True)  # before FSDP2's own post-forward hook
    sharded.append(model)
    plan.gradient_divisor = gradient_excess(mesh, kwargs["mp_policy"], dtype)
    if plan.gradient_divisor > 1:
        for module in sharded:
            module.set_all_reduce_hook(functools.partial(_divide_, by=plan.gradient_divisor))
    return plan


# The media encoders' outputs a family's forward returns beside the loss (transformers 5.x): the vision
# tower's features split per image, views of one tensor. FSDP2 puts the root's pre-backward hook on
# every tensor the root returns and warns about each view ("an in-place op on this view will silently
# drop the pre-backward hook"); nothing reads them, so they are detached before it sees them (values
# to read, not a second way into the graph: the loss holds it; why no gradient was dropped: docs/TESTING.md)
MEDIA_OUTPUTS = ("image_outputs", "video_outputs", "audio_outputs")


def _detach_media_outputs(module: nn.Module, args, output):
    if isinstance(output, dict):  # HF's output classes (a tuple output is left as it is)
        for name in MEDIA_OUTPUTS:
            if output.get(name) is not None:
                output[name] = _detached(output[name])
    return output


def _detached(value):
    """``value`` with its tensors detached; an HF output's fields replaced in place (it is this call's own)."""
    if isinstance(value, dict):
        for key in list(value.keys()):
            value[key] = _detached(value[key])
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value.detach() if torch.is_tensor(value) else value


def _experts_dim_1(param: nn.Parameter) -> Shard:
    return Shard(1)


def _shard_experts(experts: ExpertGroups, parallel_cfg, kwargs: dict, dtype: torch.dtype, plan: ShardPlan) -> None:
    """Each experts module its own FSDP group on the ``efsdp`` ranks, sharded on dimension 1 (a rank's whole
    experts, dimension 0, may be fewer than those ranks).

    FSDP averages an expert's gradient over ``efsdp``; it already sums its ``ep`` group's tokens (the
    all-to-all's backward brought them), so a hook divides by ``ep`` as well: the world's average,
    as every other group's. (Not ``set_gradient_divide_factor``: that is a ``PREMUL_SUM``, which gloo lacks.)
    """
    efsdp = experts.mesh["efsdp"]
    by = experts.mesh["ep"].size() * gradient_excess(efsdp, kwargs["mp_policy"], dtype)
    for name, module in experts.modules:
        fully_shard(module, reshard_after_forward=parallel_cfg.reshard_after_forward,
                    shard_placement_fn=_experts_dim_1, **{**kwargs, "mesh": efsdp})  # fmt: skip
        module.set_all_reduce_hook(functools.partial(_divide_, by=by))
        plan.groups.append(module_path(name))


class _Probe(nn.Module):
    """One parameter whose gradient is 1.0 everywhere, on every rank."""

    def __init__(self, numel: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel, dtype=dtype))  # zeros: draws nothing from the RNG

    def forward(self) -> torch.Tensor:
        return self.weight.sum()


def gradient_excess(mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, dtype: torch.dtype) -> int:
    """How many times too large FSDP's reduced gradients come out on ``mesh``.

    1 where FSDP averages over the ranks, as documented (and as the trainer's ``loss *
    world_size`` assumes); the number of ranks where the backend sums instead. torch 2.7's gloo
    ``reduce_scatter_tensor`` takes ``ReduceOp.AVG`` and silently sums (pytorch/pytorch#162338),
    and FSDP2 reduces fp32/bf16 gradients with AVG, so on CPU every gradient came out
    ``world_size`` times too large. Asked of FSDP itself, on a throwaway module with the same mesh,
    mixed precision and parameter dtype, so the answer holds for whichever path (AVG, or pre/post
    division with SUM for fp16) the installed torch takes; costs one tiny reduce-scatter. Each
    rank reads its own shard (the same answer on every rank: one backend, one collective).
    """
    ranks = mesh.size()
    if ranks == 1:
        return 1
    probe = _Probe(ranks, dtype)  # one element per rank: every rank's shard is one reduced value
    fully_shard(probe, mesh=mesh, mp_policy=mp_policy)  # no CPU offload: it moves shards, not sums
    probe().backward()
    got = probe.weight.grad.to_local().float()  # each rank contributed 1.0
    for divisor in (1, ranks):
        if torch.allclose(got, torch.full_like(got, float(divisor))):
            return divisor
    raise RuntimeError(
        f"FSDP's gradient reduction over {ranks} ranks ({mesh.device_type}, torch {torch.__version__}) "
        f"turned 1.0 on every rank into {got.tolist()}: neither the average nor the sum"
    )


def _divide_(grad: torch.Tensor, by: int) -> None:
    grad.div_(by)


def tied_outside(model: nn.Module, matched: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """Matched modules holding a parameter that is also reachable under a name outside them."""
    owners = {n: group for group in tied_groups(model) for n in group}
    out = {}
    for name, module in matched:
        for pname, _ in module.named_parameters(remove_duplicate=False):
            others = [o for o in owners.get(f"{name}.{pname}", ()) if not o.startswith(name + ".")]
            if others:
                out[name] = f"{name}.{pname} is tied to {module_path(others[0])}"
                break
    return out


# ---------------------------------------------------------------------------------------------
# Meta-device init


def materialize(model: nn.Module, device: torch.device, cpu_offload: bool = False) -> None:
    """Give a meta-initialised, sharded model real (uninitialised) storage and real buffers.

    Only the shards get storage: a 7B model never sits whole in one rank's memory. Weights are
    loaded afterwards (:func:`qwenkit.distributed.weights.load_hf_weights`). Non-persistent buffers (rotary
    ``inv_freq``) are not in any checkpoint, so they are recomputed by building the module tree
    once more with parameters on meta and buffers on the CPU
    (:func:`qwenkit.distributed.meta.build_on_meta`), and copied over by name.
    """
    model.to_empty(device="cpu" if cpu_offload else device)
    real = dict(build_on_meta(type(model), model.config).named_buffers())
    for name, buf in list(model.named_buffers()):
        src = real.get(module_path(name))
        if src is None:
            raise RuntimeError(f"meta init: buffer {name!r} has no counterpart to initialise it from")
        set_buffer(model, name, src.to(buf.device))
