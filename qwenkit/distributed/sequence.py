"""Ulysses sequence parallelism (``parallel.sp_size``): one micro-batch on a group of N ranks.

Ranks ``[g*N, (g+1)*N)`` form sequence-parallel group ``g``; data parallelism runs over the
``world / N`` groups (the sampler deals one micro-batch per group, :func:`init_groups`). FSDP2
still shards the weights over all ranks. Inside a group every rank receives the same
micro-batch and :meth:`SequenceParallel.forward` (the model's forward when
``model.sequence_parallel`` is set) runs it like this:

1. **positions on the whole sequence**: mRoPE ``[3, B, S]`` from the model's ``get_rope_index``
   (packed rows: per sample, :meth:`~qwenkit.model.qwen2_5_vl.QwenkitQwen2_5_VL.packed_position_ids`),
   and the labels shifted on the whole sequence (``shift_labels``); then the sequence is padded
   to a multiple of N (padding labelled ``-100``: never learned) and rank ``r`` keeps the
   contiguous slice ``[r*S/N, (r+1)*S/N)`` of ids, positions and shifted labels;
2. **vision split**: the images and the temporal patches of the videos are dealt to the N ranks
   in order (contiguous, balanced by patches, :func:`partition`); each rank encodes only its
   share, the merged features are all-gathered (:func:`gather_features`, whose gradient sums the
   ranks' gradients and keeps this rank's rows) and each rank scatters the features of the
   placeholders in its slice. A rank whose share is empty runs the tower on one blank patch
   (the idle-tower rule: every rank issues the same FSDP collectives);
3. **decoder on the slice**, with the attention function registered in transformers' attention
   interface as ``qwenkit_ulysses_<inner>`` (:func:`ulysses_attention`): an all-to-all turns
   ``[B, H, S/N, D]`` into ``[B, H/N, S, D]``, the inner attention (sdpa, eager maths) runs on the
   whole sequence with the mask built on the whole sequence (causal, padding, packed-sample
   blocks), and a second all-to-all turns it back. KV heads are replicated when N does not
   divide them; ``heads % N != 0`` is refused before start (:func:`heads_problem`);
4. **loss on the slice**: the chunked head with this slice's shifted labels, normalised by the
   valid-token count of the whole (global) batch, so the sum over the group's ranks is the
   unsplit loss and the summed gradients are the unsplit run's.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qwenkit.model.loss import IGNORE_INDEX, TOKEN_SUM, chunked_linear_cross_entropy, shift_labels
from qwenkit.model.processor import needs_mm_token_type_ids

ATTENTION_PREFIX = "qwenkit_ulysses_"
INNER = ("sdpa", "eager")  # flash_attention_2: not yet (see docs/SEQUENCE_PARALLEL.md)


# ---------------------------------------------------------------------------------------------
# Groups and the config check


@dataclass
class SequenceParallel:
    """This rank's sequence-parallel group, and the model forward that uses it."""

    group: dist.ProcessGroup | None
    rank: int  # within the group
    size: int
    dp_rank: int  # which group (the sampler's rank)
    dp_size: int  # how many groups (the sampler's world size)

    def forward(self, model, input_ids, labels, use_cache, logits_to_keep, loss_type, num_items_in_batch,
                num_samples, packed_seq_lens, kwargs):  # fmt: skip
        return _forward(self, model, input_ids, labels, use_cache, logits_to_keep, loss_type, num_items_in_batch,
                        num_samples, packed_seq_lens, kwargs)  # fmt: skip


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
    SP context (generation, a forward outside :meth:`SequenceParallel.forward`) the registered
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


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sequence_parallel: AttentionContext | None = None, inner: str = "sdpa", **kwargs):  # fmt: skip
    """transformers attention function: Ulysses around ``inner`` (``[B, S/N, H, D]``, None)."""
    if sequence_parallel is None:  # not under SP (generation, a plain forward): the inner one as is
        return _inner_function(inner)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
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


def _inner_function(inner: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if inner == "eager":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import eager_attention_forward

        return eager_attention_forward
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


def _tower(visual, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Merged features ``[tokens, H]`` of the vision tower (4.57 returns them, 5.x a pooler_output)."""
    out = visual(pixels, grid_thw=grid)
    return out if torch.is_tensor(out) else out.pooler_output


def _blank(visual) -> tuple[torch.Tensor, torch.Tensor]:
    """One blank merged patch group: the smallest legal tower input (the idle-tower rule)."""
    m = visual.spatial_merge_size
    pe = visual.patch_embed
    width = pe.in_channels * pe.temporal_patch_size * pe.patch_size**2
    param = next(visual.parameters())
    return torch.zeros(m * m, width, device=param.device, dtype=param.dtype), torch.tensor(
        [[1, m, m]], device=param.device
    )


def encode_share(visual, pixels: torch.Tensor, grid_thw: torch.Tensor, sp: SequenceParallel):
    """``(all features [tokens, H], idle term)``: this rank encodes its units, then all-gather.

    Every rank calls the tower exactly once here, on its share or on one blank patch group.
    """
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
        local = _tower(visual, pixels[first : first + rows[sp.rank]].to(param.dtype), grid)
    else:
        out = _tower(visual, *_blank(visual))
        local, idle = out[:0], out.sum() * 0.0
    visual.sp_inputs = getattr(visual, "sp_inputs", 0) + (rows[sp.rank])  # patch rows encoded here (tests)
    return gather_features(local, counts, sp.rank, sp.group), idle


def _scatter(embeds, features, ids_full, token_id: int, lo: int, hi: int) -> torch.Tensor:
    """Put the features of the placeholders inside ``[lo, hi)`` into this slice's embeddings."""
    is_token = ids_full == token_id  # [B, S]
    if int(is_token.sum()) != features.shape[0]:
        raise ValueError(f"{int(is_token.sum())} placeholder tokens but {features.shape[0]} vision features")
    order = is_token.reshape(-1).cumsum(0).reshape(is_token.shape) - 1  # row-major, as masked_scatter fills
    mine = is_token[:, lo:hi]
    picked = features[order[:, lo:hi][mine]].to(embeds.dtype)
    return embeds.masked_scatter(mine.unsqueeze(-1).to(embeds.device), picked)


# ---------------------------------------------------------------------------------------------
# The forward


MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
         "mm_token_type_ids")  # fmt: skip


def _positions(model, input_ids, attention_mask, media, packed_seq_lens):
    """``(mRoPE [3, B, S], sample ids [B, S] or None)`` on the whole sequence."""
    if packed_seq_lens is not None:
        pos = model.packed_position_ids(input_ids, packed_seq_lens, media)  # [4, 1, S]
        sample_ids = torch.repeat_interleave(
            torch.arange(len(packed_seq_lens), device=input_ids.device), packed_seq_lens.to(input_ids.device)
        )[None]
        return pos[1:], sample_ids
    b, s = input_ids.shape
    if media.get("image_grid_thw") is None and media.get("video_grid_thw") is None:
        return torch.arange(s, device=input_ids.device).view(1, 1, -1).expand(3, b, -1), None
    kwargs = {k: media.get(k) for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
    if needs_mm_token_type_ids():
        types = media.get("mm_token_type_ids")
        kwargs["mm_token_type_ids"] = types if types is not None else model._token_types(input_ids)
    pos, _ = model.model.get_rope_index(input_ids, attention_mask=attention_mask, **kwargs)
    return pos, None


def _forward(sp, model, input_ids, labels, use_cache, logits_to_keep, loss_type, num_items_in_batch, num_samples,
             packed_seq_lens, kwargs):  # fmt: skip
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if not model.chunk_loss:
        raise ValueError(
            "sequence parallelism (parallel.sp_size > 1) needs the chunked loss head (loss.chunk=true)"
        )
    if loss_type not in ("token_mean", TOKEN_SUM):  # token_sum: evaluation's per-slice sum
        raise ValueError(f"sequence parallelism supports loss.loss_type=token_mean, got {loss_type!r}")
    shifted = kwargs.pop("shift_labels", None)
    model._check_chunk_args(labels, shifted, use_cache, logits_to_keep, loss_type)
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError("sequence parallelism needs input_ids (not inputs_embeds)")
    attention_mask = kwargs.pop("attention_mask", None)
    position_ids = kwargs.pop("position_ids", None)
    media = {k: kwargs.pop(k, None) for k in MEDIA}
    if packed_seq_lens is not None and attention_mask is not None:
        raise ValueError("a packed row takes no attention_mask: the block mask comes from the positions")
    n, device = sp.size, input_ids.device
    b, s = input_ids.shape

    # 1. positions, shifted labels and the mask on the whole sequence; pad to a multiple of N; slice
    if position_ids is None:
        mrope, sample_ids = _positions(model, input_ids, attention_mask, media, packed_seq_lens)
    else:
        mrope, sample_ids = (position_ids[1:], None) if position_ids.shape[0] == 4 else (position_ids, None)
    if shifted is None:
        shifted = shift_labels(labels)
    if num_items_in_batch is None:
        num_items_in_batch = (shifted != IGNORE_INDEX).sum()  # the whole batch's, on every rank
    pad = (-s) % n
    width = (s + pad) // n
    lo, hi = sp.rank * width, (sp.rank + 1) * width
    ids = F.pad(input_ids, (0, pad), value=_filler_id(model))
    shifted = F.pad(shifted, (0, pad), value=IGNORE_INDEX)
    mrope = F.pad(mrope, (0, pad), value=0)
    if sample_ids is not None:
        sample_ids = F.pad(sample_ids, (0, pad), value=-1)
    if attention_mask is not None:
        attention_mask = F.pad(attention_mask, (0, pad), value=0)
    mask = full_mask(attention_mask, sample_ids, s + pad, device)

    # 2. this slice's embeddings; the vision share, gathered and scattered; idle calls owed
    embeds = model.model.get_input_embeddings()(ids[:, lo:hi])
    extra, calls = [], 0
    cfg = model.config
    for pixels, grid, token in (
        (media["pixel_values"], media["image_grid_thw"], cfg.image_token_id),
        (media["pixel_values_videos"], media["video_grid_thw"], cfg.video_token_id),
    ):
        if pixels is None:
            continue
        features, idle = encode_share(model.model.visual, pixels, grid, sp)
        embeds = _scatter(embeds, features, ids, token, lo, hi)
        calls += 1
        if idle is not None:
            extra.append(idle)
    for _ in range(max(0, model.vision_calls_per_step - calls)):
        extra.append(model._idle_vision_term())

    # 3. the decoder on the slice, attention on the whole sequence
    ctx = AttentionContext(sp.group, n, mask)
    out = model.model.language_model(
        input_ids=None, inputs_embeds=embeds, position_ids=mrope[:, :, lo:hi], attention_mask=None,
        use_cache=False, return_dict=True, sequence_parallel=ctx, **kwargs,
    )  # fmt: skip

    # 4. the chunked loss of this slice, normalised by the whole batch's count
    loss_fn = functools.partial(
        chunked_linear_cross_entropy,
        shifted=shifted[:, lo:hi],
        loss_type=loss_type,
        chunk_size=model.chunk_size,
        chunk_budget_bytes=model.chunk_budget_bytes,
        num_items_in_batch=num_items_in_batch,
        num_samples=num_samples if num_samples is not None else b,
    )
    loss = model.lm_head(out.last_hidden_state, labels=None, loss_fn=loss_fn)
    for term in extra:
        loss = loss + term
    return CausalLMOutputWithPast(loss=loss)


def _filler_id(model) -> int:
    """A token id for the padding to a multiple of N: any id that is not a placeholder."""
    cfg = model.config
    pad = getattr(cfg, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    return int(pad) if pad is not None and pad not in (cfg.image_token_id, cfg.video_token_id) else 0
