"""Embedding tables sharded on their columns (dim 1) across every rank, never whole on one: Qwen4-Exp's n-gram tables.

A Qwen4-Exp PLE layer's n-gram table (``ple.ple_embedding.ngram_embedding``, ``[V, d]``) has ~320M rows of
``d = ple_embed_dim / n-gram heads`` columns in the real checkpoint (320M x 128 at the config's defaults:
~76 GiB in bf16 for one table), and each token reads 16 of its rows. FSDP2 shards a weight on dim 0
and all-gathers it whole before every forward: that is the whole table on every rank, which is what must
never happen. So a family's entry names such tables (``Family.column_sharded``) and they are kept out of
FSDP (``fully_shard(ignored_params=...)``, :func:`qwenkit.distributed.fsdp.shard`), each its own DTensor
``Shard(1)`` on a 1-D mesh of all ranks: rank ``r`` holds columns ``[r d/W, (r+1) d/W)`` of every row,
``1/W`` of the table, for good: weights, gradient and AdamW state alike (where ``W`` does not divide ``d``,
``torch.chunk``'s split: ``ceil(d/W)`` columns, fewer or none on the last ranks). Dim 1 because the checkpoint
splits the table on dim 0 (``split_ngram_parts`` parts, ``<table>.shard_<i>.weight``: transformers'
``Concatenate(dim=0)``): each rank reads its columns of every part (:func:`read_parts`) and no rank reads
another's, as transformers' own TP plan for the table (``embedding_colwise``) does.

The lookup (:func:`lookup`) is exact, the same rows as ``F.embedding`` on the whole table:

1. every rank's ids are all-gathered (``N_r`` ids on rank ``r``; a few int64 per token);
2. each rank looks all of them up in its columns: ``[sum_r N_r, d/W]``;
3. one ``all_to_all_single`` sends rank ``r`` its own ids' rows: it receives ``W`` blocks ``[N_r, d/W]``,
   one per column shard, and lays them side by side: ``[N_r, d]`` (blocks of uneven shards padded to one width
   for the exchange, the padding dropped).

Backward runs the same way reversed (the all-to-all's transpose), and the embedding's backward adds every
rank's gradient rows into this rank's columns: the sum over the ranks' tokens, divided by ``W`` to be the
average FSDP2 takes of every other gradient (the trainer's backward runs on ``loss * world_size``). Every
rank takes part in every lookup, forward and backward, as in every FSDP2 unit's all-gather: HF rollouts
step together (:class:`qwenkit.engine.rollouts.hf.HfRollouts`: HF's ``synced_gpus``, the FSDP2 units gathered
once or not). Memory of one lookup: the gathered ids and ``sum_r N_r x d/W`` rows, a small multiple of a
rank's own ``N_r x d``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from qwenkit.distributed.expert import AllToAll
from qwenkit.model.modules import module_path, path_match


def tables(model: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, nn.Embedding]]:
    """The embedding modules matching ``patterns`` (the entry's ``column_sharded``), in model order."""
    return [(n, m) for n, m in model.named_modules() if any(path_match(module_path(n), p) for p in patterns)]


def apply(model: nn.Module, patterns: tuple[str, ...], mesh: DeviceMesh, dtype: torch.dtype | None) -> set[nn.Parameter]:
    """Shard each table matching ``patterns`` on its columns over ``mesh`` (1-D, every rank) and look it up
    by :func:`lookup`, its rows cast to ``dtype`` (``parallel.param_dtype``: what FSDP2 would compute with).
    Returns the tables' parameters, which FSDP must leave alone. Call before ``fully_shard``."""
    params = set()
    for _, module in tables(model, patterns):
        shard_columns(module, mesh)
        install(module, mesh, dtype)
        params.add(module.weight)
    return params


def widths(columns: int, world: int) -> list[int]:
    """Each rank's number of columns: ``torch.chunk``'s split, as DTensor's ``Shard(1)`` cuts (``ceil(d / W)`` each,
    the last ranks fewer or none where ``W`` does not divide ``d``)."""
    width = -(-columns // world)
    return [max(0, min(width, columns - r * width)) for r in range(world)]


@torch.no_grad()
def shard_columns(module: nn.Embedding, mesh: DeviceMesh) -> None:
    """Keep this rank's columns of the table as a ``Shard(1)`` DTensor of the global shape (the HF key and
    shape stay: DCP checkpoints do not depend on the world size). On meta the slice is meta too (the weights
    are read later: :func:`read_parts`); otherwise it is copied and the whole table freed."""
    weight, world, rank = module.weight, mesh.size(), mesh.get_local_rank()
    start = sum(widths(weight.shape[1], world)[:rank])
    piece = weight[:, start : start + widths(weight.shape[1], world)[rank]].clone()  # [V, d_r]
    if not piece.is_meta:
        piece = piece.to(mesh.device_type)
    dt = DTensor.from_local(piece, mesh, [Shard(1)], run_check=False, shape=weight.shape, stride=weight.stride())
    module.weight = nn.Parameter(dt, requires_grad=weight.requires_grad)


def install(module: nn.Embedding, mesh: DeviceMesh, dtype: torch.dtype | None) -> None:
    group = mesh.get_group()

    def forward(ids: torch.Tensor) -> torch.Tensor:
        rows = lookup(module.weight, ids, group)
        return rows if dtype is None else rows.to(dtype)

    module.forward = forward
    module.qwenkit_column_sharded = True


def sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds a column-sharded table over more than one rank: its forward is then a collective."""
    return any(getattr(m, "qwenkit_column_sharded", False) and m.weight.device_mesh.size() > 1 for m in model.modules())


def lookup(weight: torch.Tensor, ids: torch.Tensor, group) -> torch.Tensor:
    """``F.embedding(ids, weight)`` of a ``Shard(1)`` table ``[V, d]`` over ``group``'s ``W`` ranks: ``[*ids.shape, d]``
    (the module docstring's steps). Collective: every rank calls it, each with its own ids."""
    world = dist.get_world_size(group)
    local = weight.to_local()  # [V, d/W], autograd into the DTensor's gradient
    flat = ids.reshape(-1)
    mine = flat.numel()
    counts = torch.tensor([mine], device=flat.device)
    every = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(every, counts, group=group)
    sizes = [int(c) for c in every]
    most = max(sizes)
    gathered = flat.new_empty(world * most)
    dist.all_gather_into_tensor(gathered, F.pad(flat, (0, most - mine)), group=group)
    all_ids = torch.cat([gathered[r * most : r * most + n] for r, n in enumerate(sizes)])  # [sum_r N_r]
    rows = F.embedding(all_ids, local)  # [sum_r N_r, d_me]: my columns of every rank's rows
    if rows.requires_grad and world > 1:
        rows.register_hook(lambda grad: grad / world)  # the sum over the ranks' tokens -> FSDP2's average
    split = widths(weight.shape[1], world)  # d_r of each rank: equal unless W does not divide d
    rows = F.pad(rows, (0, split[0] - rows.shape[1]))  # [sum_r N_r, ceil(d/W)]: one width for the exchange
    got = AllToAll.apply(rows, [mine] * world, sizes, group).view(world, mine, -1)  # [W, N, ceil(d/W)]
    return torch.cat([got[r, :, :w] for r, w in enumerate(split)], dim=-1).view(*ids.shape, -1)  # [*ids, d]


# ---------------------------------------------------------------------------------------------
# The checkpoint's split parts


def part_sources(key: str, by_model_key: dict[str, str]) -> list[str] | None:
    """The file keys of the parts a checkpoint splits the table ``key`` into (``...ngram_embedding.weight`` ->
    ``...ngram_embedding.shard_<i>.weight``, ``i = 0, 1, ...``: transformers' names), in order along dim 0;
    None when the checkpoint does not split it."""
    module, _, leaf = key.rpartition(".")
    parts = []
    while (name := f"{module}.shard_{len(parts)}.{leaf}") in by_model_key:
        parts.append(by_model_key[name])
    return parts or None


@torch.no_grad()  # a parameter, filled in place
def read_parts(target: torch.Tensor, sources: list[str], files: dict[str, Path]) -> None:
    """Fill a table (a ``Shard(1)`` DTensor or a plain tensor) from its checkpoint parts, each ``[V_i, d]`` rows
    ``torch.chunk`` cut along dim 0: this rank reads only its columns of each part (``get_slice``)."""
    local, columns = target, slice(0, target.shape[1])
    if isinstance(target, DTensor):
        local = target.to_local()
        (chunk,) = target.__create_chunk_list__()
        columns = slice(chunk.offsets[1], chunk.offsets[1] + chunk.sizes[1])
    start = 0
    for key in sources:
        with safe_open(str(files[key]), framework="pt") as f:
            part = f.get_slice(key)
            rows, width = part.get_shape()
            if width != target.shape[1]:
                raise ValueError(f"{files[key]}: {key!r} has {width} columns, the model's table {target.shape[1]}")
            local[start : start + rows].copy_(part[:, columns])
        start += rows
    if start != target.shape[0]:
        raise ValueError(f"the checkpoint's {len(sources)} parts of the table hold {start} rows, the model's "
                         f"{target.shape[0]} ({sources[0]} ...)")  # fmt: skip

