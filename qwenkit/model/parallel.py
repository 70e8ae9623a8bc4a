"""The model's forward on one rank's slice of the sequence (Ulysses sequence parallelism).

``model.sequence_parallel`` (set by :func:`qwenkit.distributed.sequence.enable`) is this rank's
group; the forward of :class:`~qwenkit.model.families.chunked.ChunkLossMixin` then runs
:func:`forward_slice`. The group object brings the communication (``sp.encode`` deals the
vision units and all-gathers their features, ``sp.attention_context`` and ``sp.full_mask``
the attention on the whole sequence); the steps are the model's:

1. **positions on the whole sequence**: mRoPE ``[3, B, S]`` from the model's ``get_rope_index``
   (packed rows: per sample, :meth:`~qwenkit.model.families.positions.Positions.packed_position_ids`),
   and the labels shifted on the whole sequence (``shift_labels``); then the sequence is padded
   to a multiple of N (padding labelled ``-100``: never learned) and rank ``r`` keeps the
   contiguous slice ``[r*S/N, (r+1)*S/N)`` of ids, positions and shifted labels;
2. **vision**: each rank encodes its share of the images and temporal patches, the features are
   gathered, and each rank scatters the features of the placeholders in its slice; DeepStack
   features (Qwen3-VL) go with them, to the same visual positions of the slice;
3. **decoder on the slice**, attention on the whole sequence (the registered Ulysses attention);
4. **loss on the slice**: the chunked head with this slice's shifted labels, normalised by the
   valid-token count of the whole (global) batch, so the sum over the group's ranks is the
   unsplit loss and the summed gradients are the unsplit run's;
5. **the MTP layer** (``model.mtp.train``, Qwen3.5) on the slice's hidden states, its shifted ids and
   targets built on the whole sequence and sliced (:func:`qwenkit.model.families.mtp.mtp_loss`), its
   attention the backbone's full attention under Ulysses, normalised as step 4's.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qwenkit.model.families.linear_attention import boundaries
from qwenkit.model.losses.cross_entropy import (
    IGNORE_INDEX,
    TOKEN_SUM,
    shift_labels,
)

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
    return model.rope_index(input_ids, attention_mask=attention_mask, media=media), None


def slice_rows(ids_full: torch.Tensor, token_id: int, lo: int, hi: int, features: int):
    """``(placeholders of token_id inside [lo, hi) [B, hi-lo], their feature rows)``.

    Feature rows follow the placeholders in row-major order over the whole batch, as HF's
    ``masked_scatter`` fills them.
    """
    is_token = ids_full == token_id  # [B, S]
    if int(is_token.sum()) != features:
        raise ValueError(f"{int(is_token.sum())} placeholder tokens but {features} vision features")
    order = is_token.reshape(-1).cumsum(0).reshape(is_token.shape) - 1
    mine = is_token[:, lo:hi]
    return mine, order[:, lo:hi][mine]


def forward_slice(model, sp, input_ids, labels, use_cache, logits_to_keep, loss_type, num_items_in_batch,
                  num_samples, packed_seq_lens, kwargs):  # fmt: skip
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if not model.chunk_loss:
        raise ValueError(
            "sequence parallelism (parallel.sp_size > 1) needs the chunked loss head (loss.chunk=true)"
        )
    if loss_type not in ("token_mean", TOKEN_SUM):  # token_sum: evaluation's per-slice sum
        raise ValueError(f"sequence parallelism supports loss.loss_type=token_mean, got {loss_type!r}")
    shifted = kwargs.pop("shift_labels", None)
    model.check_chunk_args(labels, shifted, use_cache, logits_to_keep, loss_type)
    b = input_ids.shape[0] if input_ids is not None else 0
    out, shifted, extra, num_items_in_batch = _decoder_on_slice(model, sp, input_ids, labels, shifted,
                                                                num_items_in_batch, packed_seq_lens, kwargs)  # fmt: skip

    # 4. the chunked loss of this slice, normalised by the whole batch's count
    loss_fn = model.chunk_loss_fn(shifted, loss_type, num_items_in_batch, num_samples if num_samples is not None else b)
    loss = model.lm_head(out.last_hidden_state, labels=None, loss_fn=loss_fn)
    # 5. the MTP layer (model.mtp.train) on the same slice: its ids and targets shifted on the whole sequence
    loss = model.with_mtp_loss(loss, out.last_hidden_state, input_ids, labels, packed_seq_lens, loss_fn, loss_type,
                               view=functools.partial(_slice_of, sp=sp))  # fmt: skip
    for term in extra:
        loss = loss + term
    return CausalLMOutputWithPast(loss=loss)


def _bounds(length: int, sp) -> tuple[int, int, int]:
    """``(pad, lo, hi)``: the whole sequence padded to a multiple of N, this rank's slice ``[lo, hi)`` of it."""
    pad = (-length) % sp.size
    width = (length + pad) // sp.size
    return pad, sp.rank * width, (sp.rank + 1) * width


def _slice_of(t: torch.Tensor, fill: int, sp) -> torch.Tensor:
    """This rank's slice ``[B, (S + pad) / N]`` of a whole-sequence ``t [B, S]``, padded with ``fill``."""
    pad, lo, hi = _bounds(t.shape[1], sp)
    return F.pad(t, (0, pad), value=fill)[:, lo:hi]


def token_logps_slice(model, sp, head_fn, input_ids, labels, packed_seq_lens, kwargs) -> tuple:
    """``(logps [B, S], entropies [B, S] or None)`` of the whole sequence (GRPO's ``token_logps``), from this
    rank's slice: steps 1-3, then ``head_fn`` (:func:`qwenkit.model.losses.logps.token_logps`) on the slice's
    pre-shifted labels, and the slices all-gathered over the group (:func:`gather_slices`: each rank's
    gradient flows back through its own slice only, so the group's summed gradients are the unsplit
    forward's when every rank takes the same loss of the whole sequence:
    :meth:`qwenkit.distributed.sequence.SequenceParallel.share`). DPO's per-sequence sums are these summed
    (:meth:`~qwenkit.model.families.chunked.ChunkLossMixin.sequence_logps`). The idle vision terms join the logps."""
    s = input_ids.shape[1]
    out, shifted, extra, _ = _decoder_on_slice(model, sp, input_ids, labels, None, None, packed_seq_lens, kwargs)
    loss_fn = functools.partial(head_fn, chunk_size=model.chunk_size, chunk_budget_bytes=model.chunk_budget_bytes,
                                shifted=shifted)  # fmt: skip
    logps, entropies = model.lm_head(out.last_hidden_state, labels=None, loss_fn=loss_fn)  # [B, S/N] each
    logps = gather_slices(logps, sp, s)
    entropies = gather_slices(entropies.detach(), sp, s) if entropies is not None else None
    for term in extra:
        logps = logps + term
    return logps, entropies


class _GatherSlices(torch.autograd.Function):
    """All-gather of the group's ``[B, S/N]`` slices along the sequence, the padding cut; backward: this rank's
    slice of the gradient (the padding's is 0)."""

    @staticmethod
    def forward(ctx, local, rank, size, group, length):
        ctx.rank, ctx.width, ctx.size = rank, local.shape[1], size
        pieces = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces, dim=1)[:, :length].clone()  # a new tensor, not a view (FSDP's output hooks)

    @staticmethod
    def backward(ctx, grad):
        whole = F.pad(grad, (0, ctx.width * ctx.size - grad.shape[1]))  # [B, S + pad]
        return whole[:, ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None, None, None, None


def gather_slices(local: torch.Tensor, sp, length: int) -> torch.Tensor:
    """``[B, length]`` of the whole sequence from every rank's ``[B, (length + pad) / N]`` (:class:`_GatherSlices`)."""
    return _GatherSlices.apply(local, sp.rank, sp.size, sp.group, length)


def _decoder_on_slice(model, sp, input_ids, labels, shifted, num_items_in_batch, packed_seq_lens, kwargs):
    """Steps 1-3: ``(decoder outputs of this slice, its shifted labels, the idle vision terms, the batch's count)``."""
    if input_ids is None or kwargs.get("inputs_embeds") is not None:
        raise ValueError("sequence parallelism needs input_ids (not inputs_embeds)")
    model._prepare_backbone(kwargs)
    if kwargs.get("output_router_logits"):
        raise ValueError(
            "sequence parallelism with the MoE router's auxiliary loss is not supported: the load-balancing "
            "loss of the slices is not the loss of the sequence (set output_router_logits=false in the model config)"
        )
    kwargs.pop("output_router_logits", None)
    attention_mask = kwargs.pop("attention_mask", None)
    position_ids = kwargs.pop("position_ids", None)
    media = {k: kwargs.pop(k, None) for k in MEDIA}
    if packed_seq_lens is not None and attention_mask is not None:
        raise ValueError("a packed row takes no attention_mask: the block mask comes from the positions")
    device = input_ids.device
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
    pad, lo, hi = _bounds(s, sp)
    ids = F.pad(input_ids, (0, pad), value=_filler_id(model))
    shifted = F.pad(shifted, (0, pad), value=IGNORE_INDEX)
    mrope = F.pad(mrope, (0, pad), value=0)
    if sample_ids is not None:
        sample_ids = F.pad(sample_ids, (0, pad), value=-1)
    if attention_mask is not None:
        attention_mask = F.pad(attention_mask, (0, pad), value=0)
    mask = sp.full_mask(attention_mask, sample_ids, s + pad, device)

    # 2. this slice's embeddings; the vision share, gathered and scattered; idle calls owed
    embeds = model.model.get_input_embeddings()(ids[:, lo:hi])
    extra, calls, visual = [], 0, []  # visual: (positions in the slice, DeepStack rows) per modality
    cfg = model.config
    for pixels, grid, token in (
        (media["pixel_values"], media["image_grid_thw"], cfg.image_token_id),
        (media["pixel_values_videos"], media["video_grid_thw"], cfg.video_token_id),
    ):
        if pixels is None:
            continue
        features, idle = sp.encode(model, pixels, grid)  # [merged, *DeepStack], each [tokens, H]
        mine, rows = slice_rows(ids, token, lo, hi, features[0].shape[0])
        embeds = embeds.masked_scatter(mine.unsqueeze(-1).to(embeds.device), features[0][rows].to(embeds.dtype))
        visual.append((mine, [f[rows] for f in features[1:]]))
        calls += 1
        if idle is not None:
            extra.append(idle)
    for _ in range(max(0, model.vision_calls_per_step - calls)):
        extra.append(model.idle_vision_term())

    # 3. the decoder on the slice, attention (and Qwen3.5's linear attention) on the whole sequence
    if packed_seq_lens is not None and "linear_attention" in getattr(cfg.get_text_config(), "layer_types", ()):
        # the linear-attention layers restart at each sample of the whole row (the filler: one more sample)
        kwargs.update(boundaries([*packed_seq_lens.tolist(), *([pad] if pad else [])], device))
    out = model.model.language_model(
        input_ids=None, inputs_embeds=embeds, position_ids=mrope[:, :, lo:hi], attention_mask=None,
        use_cache=False, return_dict=True, sequence_parallel=sp.attention_context(mask), **kwargs,
        **_deepstack_inputs(model, visual),
    )  # fmt: skip
    return out, shifted[:, lo:hi], extra, num_items_in_batch


def _deepstack_inputs(model, visual: list) -> dict:
    """The decoder's DeepStack inputs for this slice: the visual positions (images and videos) and,
    per DeepStack layer, their features in the order of those positions (as HF joins them)."""
    if not visual or not visual[0][1]:  # no media, or a family without DeepStack
        return {}
    joint = visual[0][0].clone()
    for mine, _ in visual[1:]:
        joint |= mine
    layers = []
    for k in range(len(visual[0][1])):
        first = visual[0][1][k]
        embed = first.new_zeros(int(joint.sum()), first.shape[-1])
        for mine, rows in visual:
            embed = embed.index_put((mine[joint].nonzero().squeeze(-1),), rows[k].to(embed.dtype))
        layers.append(embed)
    return model._decoder_visual_kwargs(joint, layers)


def _filler_id(model) -> int:
    """A token id for the padding to a multiple of N: any id that is not a placeholder."""
    cfg = model.config
    pad = getattr(cfg, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    return int(pad) if pad is not None and pad not in (cfg.image_token_id, cfg.video_token_id) else 0
