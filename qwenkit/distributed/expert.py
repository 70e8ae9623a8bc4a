"""Expert parallelism (``parallel.ep_size``): whole experts per rank, tokens sent to them.

Without it FSDP2 shards a MoE layer's fused expert weights (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) like any weight, so every rank all-gathers all ``E``
experts of a layer for every micro-batch although each token uses ``top_k`` of them. With
``ep_size = e`` the experts live on a 2-D mesh ``(efsdp, ep)`` = ``(world / e, e)``:

1. :func:`build_expert_mesh`: ``ep`` is the fast dimension, so an expert group is ``e``
   consecutive ranks (one node's fast links); ``efsdp`` strides across the groups.
2. :func:`shard_experts`: each expert weight becomes a DTensor ``Shard(0)`` on the ``ep``
   dimension: rank ``p`` of a group holds experts ``[p L, (p+1) L)``, ``L = E / e``, whole. The
   global shape and the HF key stay, so DCP checkpoints do not depend on ``ep_size`` and reshard
   like any other tensor. :func:`qwenkit.distributed.fsdp.shard` then shards those experts over
   ``efsdp`` (dimension 1: the local expert count may be smaller than ``efsdp``) and everything
   else over the whole world, as without EP.
3. :func:`install`: the experts module's forward becomes :func:`dispatch`. The router (``mlp.gate``),
   its top-k weights and its auxiliary loss are HF's, untouched: routing is per token, so each
   rank routes its own tokens exactly as before. Each (token, expert) pair goes to the expert's
   rank (one ``all_to_all_single``), the local experts run (:func:`local_experts`: one
   ``torch._grouped_mm`` per projection on CUDA in bf16, a loop over the local experts elsewhere), the
   outputs come back (a second one) and are weighted and summed per token on the sender. A
   shared expert (Qwen3.5-MoE's ``mlp.shared_expert``) is outside the routed experts module and
   stays a dense FSDP weight.

Every rank runs every local expert, with zero rows where no token came: its weight gradient is
then zero, not missing, and both exchanges run on every rank in every layer, forward and backward,
so FSDP's reduce-scatters and the all-to-alls stay in step.

Gradients: the trainer scales each rank's loss by the world size and FSDP averages. An expert's
gradient already sums the tokens of its whole ``ep`` group (the all-to-all's backward brings them),
so its FSDP group divides by the world size, not by its ``efsdp`` size alone (torchtitan sets
that factor with ``set_gradient_divide_factor``; that is a ``PREMUL_SUM``, which gloo lacks, so
qwenkit lets FSDP average over ``efsdp`` and a hook divides by ``ep``). The grad norm (:func:`total_norm`) sums each
mesh's squared norm once: every expert element lives on exactly one rank of the 2-D mesh.

Every model a run holds is split this way by one build (:func:`qwenkit.engine.run.build.sharded_model`):
the policy and DPO's or GRPO's frozen reference. Not built (refused before start by the config check):
``ep_size`` with CPU offload; transformers 4.57 (its experts take other arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from qwenkit.model.lora import ADAPTER, parameter_adapters
from qwenkit.model.modules import module_path, path_match


def build_expert_mesh(device_type: str, world_size: int, ep_size: int) -> DeviceMesh:
    """The ``(efsdp, ep)`` mesh of the experts: ``ep`` consecutive ranks share one layer's experts."""
    if world_size % ep_size:
        raise ValueError(f"parallel.ep_size={ep_size} must divide the world size {world_size}")
    return init_device_mesh(device_type, (world_size // ep_size, ep_size), mesh_dim_names=("efsdp", "ep"))


@dataclass
class ExpertGroups:
    """The routed-experts modules and their ``(efsdp, ep)`` mesh, as :func:`qwenkit.distributed.fsdp.shard` takes them."""

    mesh: DeviceMesh
    modules: list[tuple[str, nn.Module]]


def apply(model: nn.Module, patterns: tuple[str, ...], mesh: DeviceMesh) -> ExpertGroups:
    """Expert parallelism on every module matching ``patterns``: whole experts per rank, tokens dispatched.
    Call before recompute wrapping and :func:`qwenkit.distributed.fsdp.shard` (which then shards them over ``efsdp``)."""
    modules = []
    for name, module in experts_modules(model, patterns):
        base, adapters = parameter_adapters(module)  # lora.target_experts: peft's wrappers around the experts
        shard_experts(base, mesh["ep"])
        install(module, mesh["ep"])
        modules.append((name, base))
    return ExpertGroups(mesh, modules)


def experts_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The routed-experts modules (the family entry's ``experts`` paths), in model order."""
    found = [(n, m) for n, m in model.named_modules() if any(path_match(module_path(n), p) for p in patterns)]
    if not found:
        raise ValueError(f"parallel.ep_size: no module of {type(model).__name__} matches {list(patterns)}")
    return found


@torch.no_grad()
def shard_experts(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Keep this rank's whole experts of each fused weight, as a ``Shard(0)`` DTensor on ``ep_mesh``.

    On meta the slice is meta too (the weights are read later into the shards,
    :func:`qwenkit.distributed.weights.load_hf_weights`); otherwise it is copied, and the full
    tensor freed. ``num_experts`` stays the global count (the router's; the dispatch reads the
    local count off the weights).
    """
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for name, param in list(module.named_parameters(recurse=False)):
        experts = param.shape[0]
        if experts % ep:
            raise ValueError(f"parallel.ep_size={ep} must divide the expert count {experts} ({name}: {tuple(param.shape)})")
        local = experts // ep
        piece = param[rank * local : (rank + 1) * local].clone()
        if not piece.is_meta:  # on the mesh's device (the current accelerator), as FSDP2 puts its shards
            piece = piece.to(ep_mesh.device_type)
        dt = DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
        setattr(module, name, nn.Parameter(dt, requires_grad=param.requires_grad))


def install(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Replace the experts module's forward (HF's signature) with :func:`dispatch` over ``ep_mesh``.

    With LoRA on the experts (``lora.target_experts``) ``module`` is peft's wrapper: its forward would add
    each adapter's delta to the whole weight, of which this rank holds a slice; it calls the experts
    module instead (FSDP's hooks gather it), whose dispatch adds the deltas of the local experts."""
    group = ep_mesh.get_group()
    base, adapters = parameter_adapters(module)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return dispatch(base, group, hidden_states, top_k_index, top_k_weights, adapters)

    base.forward = forward
    if module is not base:
        module.forward = base.__call__


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows; its backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group) -> torch.Tensor:
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        out = rows.new_empty((sum(out_sizes), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_sizes, in_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_sizes, in_sizes = ctx.sizes
        back = grad.new_empty((sum(in_sizes), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_sizes, out_sizes, group=ctx.group)
        return back, None, None, None


def dispatch(module: nn.Module, group, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             adapters: dict[str, nn.Module] | None = None):  # fmt: skip
    """HF's experts forward over an expert group: ``hidden`` ``[T, H]``, ``top_k_*`` ``[T, k]`` (global ids);
    ``adapters``: peft's adapter of each adapted weight (:func:`expert_weight`).

    1. sort the ``T k`` (token, expert) pairs by expert: they fall into one block per owning rank;
    2. exchange the per-expert counts, then the rows (all-to-all);
    3. regroup the rows received by local expert, run the local experts;
    4. send the outputs back (all-to-all), undo the sort, weight by the router's top-k and sum per token.
    """
    ep, adapters = dist.get_world_size(group), adapters or {}
    gate_up = expert_weight(module, "gate_up_proj", adapters.get("gate_up_proj"), dist.get_rank(group))  # [L, 2I, H]
    down = expert_weight(module, "down_proj", adapters.get("down_proj"), dist.get_rank(group))  # [L, H, I]
    local = gate_up.shape[0]
    tokens, k = top_k_index.shape
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)  # [T k] pairs, grouped by expert, hence by owner
    send = hidden[order // k]  # [T k, H]
    counts = torch.bincount(ids, minlength=local * ep).view(ep, local)  # [ep, L]: sent to each rank's experts
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [ep, L]: from each rank to my experts
    send_sizes, recv_sizes = counts.sum(1).tolist(), received.sum(1).tolist()
    rows = AllToAll.apply(send, recv_sizes, send_sizes, group)  # [R, H], by source rank, then local expert
    # by local expert across sources: a stable sort of each row's local expert id
    expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(received.reshape(-1))
    regroup = torch.argsort(expert_of_row, stable=True)
    out = local_experts(rows[regroup], received.sum(0).tolist(), gate_up, down, module.act_fn)
    out = out[torch.argsort(regroup)]  # back to the order received
    back = AllToAll.apply(out, send_sizes, recv_sizes, group)  # [T k, H], in the sorted pair order
    pairs = back[torch.argsort(order)].view(tokens, k, -1)  # [T, k, H], HF's (token, slot) order
    return (pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(1).to(hidden.dtype)


def expert_weight(module: nn.Module, name: str, adapter: nn.Module | None, ep_rank: int) -> torch.Tensor:
    """This rank's experts of the weight ``name`` ``[L, ...]``, plus their LoRA deltas when ``adapter``
    (peft's, ``lora.target_experts``) is on: ``W_e + scaling B_e A_e`` for the local experts
    ``e = ep_rank L ...``, from peft's own factors (``get_delta_factors``: every expert's, ``[E, ...]``),
    folded in as peft folds them (one ``baddbmm``). The adapters are dense weights gathered whole,
    so an adapter's gradient sums, over the ranks, each expert's from the one rank that ran it."""
    weight = local_weight(getattr(module, name))
    if adapter is None or adapter.disable_adapters or ADAPTER not in adapter.lora_A:
        return weight
    lhs, rhs, scaling = adapter.get_delta_factors(ADAPTER)
    rows = slice(ep_rank * weight.shape[0], (ep_rank + 1) * weight.shape[0])
    return torch.baddbmm(weight, lhs[rows], rhs[rows], alpha=scaling)


def local_weight(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (FSDP has gathered the ``efsdp`` shards; ``to_local`` keeps autograd)."""
    return param.to_local() if isinstance(param, DTensor) else param


def grouped_mm_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """One ``torch._grouped_mm`` per projection where the device has a kernel for it (CUDA, bf16: the
    dtype its CUDA kernel takes in every torch that has it); a loop over the local experts elsewhere."""
    return device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def local_experts(
    rows: torch.Tensor, sizes: list[int], gate_up: torch.Tensor, down: torch.Tensor, act, grouped: bool | None = None
) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert (``sizes[e]`` rows for local expert ``e``), as HF computes one:
    ``down_e(act(gate) * up)`` with ``gate, up = (rows @ gate_up_e.T).chunk(2)``. Every expert runs, also on
    zero rows, so each gets a gradient (zero) and the backward is the same on every rank."""
    if grouped is None:
        grouped = grouped_mm_wanted(rows.device, rows.dtype)
    if grouped:
        offs = torch.tensor(sizes, device=rows.device).cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(act(gate) * up, down.transpose(-2, -1), offs=offs)
    outs = []
    for e, part in enumerate(rows.split(sizes)):
        gate, up = F.linear(part, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down[e]))
    return torch.cat(outs)


def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Sharded tensors grouped by their mesh (the world's, the experts'; plain tensors apart):
    DTensor ops (a foreach norm, a clip) take one mesh at a time."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of sharded gradients that may live on different meshes: each mesh's partial
    norms reduced on that mesh (an element counted on the one rank that holds it), then the squares summed."""
    norms = []
    for group in by_mesh(grads):
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
