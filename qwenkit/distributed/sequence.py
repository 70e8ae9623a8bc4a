"""Ulysses sequence parallelism (``parallel.sp_size``): one micro-batch on a group of N ranks.

Ranks ``[g*N, (g+1)*N)`` form sequence-parallel group ``g``; data parallelism runs over the
``world / N`` groups (the sampler deals one micro-batch per group, :func:`init_groups`). FSDP2
still shards the weights over all ranks. Inside a group every rank receives the same
micro-batch; the model's forward runs this rank's slice of it (:mod:`qwenkit.model.parallel`:
positions and labels on the whole sequence, slice, decoder, loss) with what this module gives:

- **the vision split** (:meth:`SequenceParallel.encode`): the images and the temporal patches
  of the videos are dealt to the N ranks in order (contiguous, balanced by patches,
  :func:`partition`); each rank encodes only its share, the tower's outputs (merged features,
  and DeepStack's for Qwen3-VL) are all-gathered (:func:`gather_features`, whose gradient sums
  the ranks' gradients and keeps this rank's rows). A rank whose share is empty runs the tower
  on one blank patch (the idle-tower rule: every rank issues the same FSDP collectives);
- **the attention** registered in transformers' attention interface as
  ``qwenkit_ulysses_<inner>`` (:func:`ulysses_attention`): an all-to-all turns
  ``[B, H, S/N, D]`` into ``[B, H/N, S, D]``, the inner attention (sdpa, eager maths) runs on the
  whole sequence with the mask built on the whole sequence (:func:`full_mask`: causal, padding,
  packed-sample blocks), and a second all-to-all turns it back. KV heads are replicated when N
  does not divide them; ``heads % N != 0`` is refused before start (:func:`heads_problem`).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION_PREFIX = "qwenkit_ulysses_"
INNER = ("sdpa", "eager")  # flash_attention_2: not yet (see docs/SEQUENCE_PARALLEL.md)


# ---------------------------------------------------------------------------------------------
# Groups and the config check


@dataclass
class SequenceParallel:
    """This rank's sequence-parallel group and what the model's slice forward asks of it."""

    group: dist.ProcessGroup | None
    rank: int  # within the group
    size: int
    dp_rank: int  # which group (the sampler's rank)
    dp_size: int  # how many groups (the sampler's world size)

    def encode(self, model, pixels: torch.Tensor, grid_thw: torch.Tensor):
        """``(every tower output of the whole batch, idle term or None)``: see :func:`encode_share`."""
        return encode_share(model, pixels, grid_thw, self)

    def share(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss every rank of the group computes whole from values gathered over the group
        (:func:`qwenkit.model.parallel.gather_slices`): valued ``loss / N``, so the group's values sum to it
        once, with the whole loss's gradient, which flows back through this rank's slice only (the gather's
        backward), so the group's summed gradients are the unsplit forward's (GRPO's and DPO's losses)."""
        return loss.detach() / self.size + (loss - loss.detach())

    def attention_context(self, mask: torch.Tensor | None) -> AttentionContext:
        return AttentionContext(self.group, self.size, mask)

    @staticmethod
    def full_mask(attention_mask, sample_ids, length: int, device) -> torch.Tensor | None:
        return full_mask(attention_mask, sample_ids, length, device)


def init_groups(rank: int, world_size: int, sp_size: int) -> SequenceParallel:
    """Groups of ``sp_size`` consecutive ranks; every rank creates every group (collective)."""
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(f"parallel.sp_size={sp_size} must be >= 1 and divide the world size {world_size}")
    mine = None
    for g in range(world_size // sp_size):
        ranks = list(range(g * sp_size, (g + 1) * sp_size))
        group = dist.new_group(ranks) if sp_size > 1 else None
        if rank in ranks:
            mine = group
    return SequenceParallel(mine, rank % sp_size, sp_size, rank // sp_size, world_size // sp_size)


def heads_problem(text_config, sp_size: int) -> str | None:
    """Why the model's attention heads cannot be split over ``sp_size`` ranks, or None."""
    if sp_size <= 1:
        return None
    heads = text_config.num_attention_heads
    kv = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % sp_size:
        return (
            f"parallel.sp_size={sp_size} must divide the model's attention heads: it has {heads} query heads "
            f"and {kv} key/value heads (Ulysses gives each rank heads/sp_size query heads)"
        )
    linear = getattr(text_config, "linear_num_key_heads", None)  # Qwen3.5's Gated DeltaNet layers
    if linear is not None and linear % sp_size:
        return (
            f"parallel.sp_size={sp_size} must divide text_config.linear_num_key_heads={linear} (and with it "
            f"linear_num_value_heads={text_config.linear_num_value_heads}): each rank runs the linear-attention "
            "layers' conv and recurrence for linear_num_key_heads/sp_size key heads on the whole sequence"
        )
    return None


def heads_problem_of(model_path, sp_size: int) -> str | None:
    """:func:`heads_problem` for the model directory ``model_path`` (its config.json)."""
    if sp_size <= 1:
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    problem = heads_problem(text, sp_size)
    return f"{problem} ({model_path})" if problem else None


def enable(model, sp: SequenceParallel) -> None:
    """Route the decoder's attention through :func:`ulysses_attention` and set the model's hook.

    Only the text config's implementation changes (the vision tower keeps its own); without an
    SP context (generation, a forward outside :func:`qwenkit.model.parallel.forward_slice`) the registered
    function is the inner implementation unchanged.
    """
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    inner = text._attn_implementation or "sdpa"
    if inner.startswith(ATTENTION_PREFIX):
        inner = inner[len(ATTENTION_PREFIX) :]
    if inner not in INNER:
        raise ValueError(f"parallel.sp_size>1 supports model.attn_implementation in {INNER}, got {inner!r}")
    name = register(inner)
    for config in {id(c): c for c in (text, model.model.language_model.config)}.values():
        config._attn_implementation = name
    model.sequence_parallel = sp


@functools.cache
def register(inner: str) -> str:
    """Register ``qwenkit_ulysses_<inner>`` in transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = ATTENTION_PREFIX + inner
    AttentionInterface.register(name, functools.partial(ulysses_attention, inner=inner))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name


# ---------------------------------------------------------------------------------------------
# The all-to-all exchange (autograd: the gradient of one direction is the other)


def _exchange(x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
    """``[B, H, S/N, D] -> [B, H/N, S, D]`` (to_heads) or back."""
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    if to_heads:  # send head group j to rank j; receive every rank's slice of my head group
        send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # [N, B, H/N, S/N, D]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)  # slices in rank order
    send = x.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [N, B, H/N, S/N, D]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, n * h, s // n, d)


class _Exchange(torch.autograd.Function):
    """The all-to-all between the sequence and head layouts; its backward is the opposite one."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _exchange(x, group, to_heads=to_heads)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.group, to_heads=not ctx.to_heads), None, None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    return _Exchange.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    return _Exchange.apply(x, group, False)


# ---------------------------------------------------------------------------------------------
# Attention


@dataclass
class AttentionContext:
    """What the registered attention needs beyond HF's arguments (passed as a forward kwarg)."""

    group: dist.ProcessGroup
    size: int
    mask: torch.Tensor | None  # [B, 1, S, S] bool on the whole sequence (True: attend); None: causal

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, S/N, D] -> [B, H/N, S, D]`` (autograd): what Qwen3.5's linear attention
        (:mod:`qwenkit.model.families.linear_attention`) exchanges, beside the attention's own."""
        return seq_to_heads(x.contiguous(), self.group)

    def to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H/N, S, D] -> [B, H, S/N, D]`` (autograd)."""
        return heads_to_seq(x.contiguous(), self.group)


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sequence_parallel: AttentionContext | None = None, inner: str = "sdpa", **kwargs):  # fmt: skip
    """transformers attention function: Ulysses around ``inner`` (``[B, S/N, H, D]``, None)."""
    if sequence_parallel is None:  # not under SP (generation, a plain forward): the inner one as is
        return _inner_function(inner, module)(module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, **kwargs)  # fmt: skip
    ctx = sequence_parallel
    n = ctx.size
    heads, kv = query.shape[1], key.shape[1]
    if kv % n:  # fewer KV heads than ranks (or not a multiple): replicate them for the exchange
        rep = math.lcm(kv, n) // kv
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q = seq_to_heads(query.contiguous(), ctx.group)  # [B, H/N, S, D]
    k = seq_to_heads(key.contiguous(), ctx.group)
    v = seq_to_heads(value.contiguous(), ctx.group)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if heads % n:
        raise ValueError(f"sequence parallelism: {heads} attention heads do not split over {n} ranks")
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=ctx.mask, dropout_p=dropout if module.training else 0.0,
        is_causal=ctx.mask is None, scale=scaling,
    )  # fmt: skip
    out = heads_to_seq(out, ctx.group)  # [B, H, S/N, D]
    return out.transpose(1, 2).contiguous(), None


def _inner_function(inner: str, module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if inner == "eager":  # not registered: the one of the attention layer's own modeling file
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[inner]


def full_mask(attention_mask: torch.Tensor | None, sample_ids: torch.Tensor | None, length: int,
              device) -> torch.Tensor | None:  # fmt: skip
    """The attention mask of the whole padded sequence ``[B, 1, S, S]`` (True: attend), or None.

    None (plain causal) when that is exact for every real token: no packing and right padding
    only (a real token never looks right, so trailing padding is invisible to it). Otherwise
    causal, within one packed sample, over real keys; every row keeps its diagonal, so padding
    rows (never learned) have no empty softmax.
    """
    right_padded = attention_mask is None or bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())
    if sample_ids is None and right_padded:
        return None
    pos = torch.arange(length, device=device)
    mask = (pos[:, None] >= pos[None, :])[None]  # [1, S, S]
    if sample_ids is not None:
        mask = mask & (sample_ids[:, :, None] == sample_ids[:, None, :])
    if not right_padded:
        mask = mask & attention_mask.bool()[:, None, :]
    mask = mask | torch.eye(length, dtype=torch.bool, device=device)[None]
    return mask[:, None]


# ---------------------------------------------------------------------------------------------
# Vision split


def vision_units(grid_thw: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """``(t, h, w, patch rows)`` per unit: each image, and each temporal patch of each video.

    Qwen2.5-VL's vision tower attends within one temporal patch (its full-attention and window
    sequences are per ``h x w`` frame group), so a video ``(t, h, w)`` encodes as ``t`` units
    ``(1, h, w)`` with the same features, in the same (time-major) order.
    """
    units = []
    for t, h, w in grid_thw.tolist():
        units += [(1, h, w, h * w)] * t
    return units


def partition(sizes: list[int], n: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` unit ranges for ``n`` ranks, balanced by ``sizes`` (greedy)."""
    total, bounds, acc, start = sum(sizes), [], 0, 0
    for r in range(n - 1):
        target = total * (r + 1) / n
        end = start
        while end < len(sizes) and acc + sizes[end] / 2 <= target:  # take a unit if most of it fits
            acc += sizes[end]
            end += 1
        bounds.append((start, end))
        start = end
    bounds.append((start, len(sizes)))
    return bounds


class _GatherFeatures(torch.autograd.Function):
    """All-gather of variable-length ``[n_r, H]`` rows in rank order; backward: sum, keep mine."""

    @staticmethod
    def forward(ctx, local, counts, rank, group):
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        width = max(counts)
        padded = local.new_zeros(width, local.shape[1])
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([p[:c] for p, c in zip(pieces, counts)])

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's loss reached my rows through its slice
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


def gather_features(local: torch.Tensor, counts: list[int], rank: int, group) -> torch.Tensor:
    return _GatherFeatures.apply(local, counts, rank, group)


def encode_share(model, pixels: torch.Tensor, grid_thw: torch.Tensor, sp: SequenceParallel):
    """``([merged, *DeepStack] features [tokens, H] of every unit, idle term)``: this rank encodes
    its units (:meth:`~qwenkit.model.families.chunked.ChunkLossMixin.vision_tower`), then all-gather.

    Every rank calls the tower exactly once here, on its share or on one blank patch group.
    """
    visual = model.model.visual
    units = vision_units(grid_thw)
    merge = visual.spatial_merge_size**2
    bounds = partition([u[3] for u in units], sp.size)
    rows = [sum(u[3] for u in units[a:b]) for a, b in bounds]
    counts = [r // merge for r in rows]
    a, b = bounds[sp.rank]
    first = sum(rows[: sp.rank])
    param = next(visual.parameters())
    idle = None
    if b > a:
        grid = torch.tensor([u[:3] for u in units[a:b]], device=grid_thw.device, dtype=grid_thw.dtype)
        local = model.vision_tower(pixels[first : first + rows[sp.rank]].to(param.dtype), grid)
    else:
        out = model.vision_tower(*model.blank_vision_input())
        local, idle = [t[:0] for t in out], sum(t.sum() for t in out) * 0.0
    return [gather_features(t, counts, sp.rank, sp.group) for t in local], idle
