"""Log-probs of the labels under ``(hidden @ weight.T (+ bias)) / temperature``, without the full logits:
per token (GRPO) and per sequence (DPO), from one chunked forward.

What GRPO needs of a completion: ``logp[b, t] = log softmax(z_t)[y_{t+1}]`` at every labelled
position, ``z_t = (h_t W^T + b) / T`` with the ``banned`` tokens' logits at ``-inf`` (those the
rollout never draws: the distribution it sampled, whose scores HF ``generate`` reports), each weighted separately by the loss (ratios, clipping, KL),
and the entropy of that distribution for the metrics. TRL computes both from ``[B, T, V]`` logits
divided by the sampling temperature (its ``selective_log_softmax_and_entropy``): at V = 151,936
and 8 completions of 2,048 tokens that is 10 GiB in float32, before the gradient. What DPO needs
is their sum over each sequence's reply (TRL's ``get_batch_logps``, ``T = 1``): the same forward,
summed (:func:`sequence_logps`). Here:

1. ``rows = positions whose shifted label != -100``          # the completion (reply) tokens
2. ``h / T`` and ``b / T`` (autograd carries the ``1 / T`` into every gradient)
3. per chunk of rows: ``z = h[rows_c] @ W.T (+ b)``, banned columns ``-inf``, ``- max``  # [C, V] float32, the one buffer
4. ``logp = z[y] - log sum exp z``; with ``entropy``, ``H = log S - sum(e^z z) / S`` from a
   second ``[C, V]`` buffer (``e^z``; a banned token's term is 0), no grad (TRL logs it detached too)
5. backward: the upstream gradient ``g [B, S]`` becomes :func:`qwenkit.model.losses.cross_entropy.chunk_pass`'s
   per-token weights ``-g`` (its loss is ``sum w (-logp)``), which recomputes each chunk (the same
   ban) and returns ``grad_h``, ``grad_W``, ``grad_b``.

Top-p / top-k are not applied to these log-probs, as TRL 1.16 does not: they shape which tokens
the rollout may draw, the loss compares the tempered distributions. Peak extra memory is that of
:func:`qwenkit.model.losses.cross_entropy.chunked_linear_cross_entropy` (one chunk plus the gradients of hidden and
weight), one more chunk buffer while entropies are computed, and ``[N, H]`` for ``h / T`` when
``T != 1``. The outputs are ``[B, S]`` float32, zero where there is no label.
"""

from __future__ import annotations

import torch

from qwenkit.model.losses.cross_entropy import (
    IGNORE_INDEX,
    auto_chunk_size,
    autocast_off,
    check_inputs,
    chunk_pass,
    compute_dtype,
    keep_on_device,
    raise_out_of_range,
    shift_labels,
)  # fmt: skip


def _row_logps_entropy(hidden, weight, bias, targets, rows, chunk, entropy: bool, banned):
    """``(logp [M], entropy [M] or None)`` float32 of the rows ``rows`` (all when None), chunk by chunk."""
    n_rows = hidden.shape[0] if rows is None else rows.numel()
    logps = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    ents = torch.empty(n_rows, dtype=torch.float32, device=hidden.device) if entropy else None
    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        h = hidden[start:end] if rows is None else hidden.index_select(0, rows[start:end])  # [C, H]
        y = targets[start:end] if rows is None else targets[rows[start:end]]  # [C]
        z = (h @ weight.T).float()  # [C, V]
        if bias is not None:
            z += bias
        if banned is not None:
            z.index_fill_(1, banned, -torch.inf)  # before the max: a banned token may hold it
        valid = y != IGNORE_INDEX
        z.sub_(z.amax(dim=1, keepdim=True))  # in place: z - max, so exp never overflows
        target = z.gather(1, torch.where(valid, y, 0)[:, None]).squeeze(1)  # [C]
        if entropy:
            p = z.exp()  # [C, V] the second buffer: e^z, unnormalised
            sum_exp = p.sum(dim=1)  # [C]
            log_s = sum_exp.log()
            p.mul_(z)
            if banned is not None:
                p.index_fill_(1, banned, 0.0)  # e^z z = 0 * -inf there: the limit, 0
            ents[start:end] = torch.where(valid, log_s - p.sum(dim=1) / sum_exp, 0.0)
            del p
        else:
            log_s = z.exp_().sum(dim=1).log()  # in place: the one buffer
        logps[start:end] = torch.where(valid, target - log_s, 0.0)
        del z  # one chunk buffer at a time (see loss.chunk_pass)
    return logps, ents


class _ChunkedTokenLogps(torch.autograd.Function):
    """Per-token label log-probs ``[B, S]``; backward recomputes each chunk against ``-g`` (module docstring, step 5)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, chunk, dtype, entropy, shape, banned):
        with autocast_off(hidden.device.type):
            b_c = bias.to(dtype) if bias is not None else None
            row_logps, row_ents = _row_logps_entropy(hidden.to(dtype), weight.to(dtype), b_c, targets, rows, chunk,
                                                     entropy, banned)  # fmt: skip
        # [B, S] tensors of their own, not views: FSDP2 warns of a module returning a view (an in-place
        # op on it would skip its backward hook)
        logps = _scatter(row_logps, rows, shape)
        ents = _scatter(row_ents, rows, shape) if entropy else None
        if entropy:
            ctx.mark_non_differentiable(ents)
        ctx.save_for_backward(hidden, weight, bias, targets, rows, banned)
        ctx.chunk, ctx.dtype = chunk, dtype
        return logps, ents

    @staticmethod
    def backward(ctx, grad_logps, _grad_ents):
        hidden, weight, bias, targets, rows, banned = ctx.saved_tensors
        # _chunk_pass's loss is sum w * (-logp): weights -g give the gradient of sum g * logp
        weights = torch.where(targets != IGNORE_INDEX, -grad_logps.float().reshape(-1), 0.0)  # [N]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with autocast_off(hidden.device.type):
            b_c = bias.to(ctx.dtype) if bias is not None else None
            _, gh, gw, gb = chunk_pass(hidden.to(ctx.dtype), weight.to(ctx.dtype), b_c, targets, weights, rows,
                                       ctx.chunk, need_h, need_w, need_b, banned)  # fmt: skip
        gh = gh.to(hidden.dtype) if gh is not None else None
        gw = gw.to(weight.dtype) if gw is not None else None
        gb = gb.to(bias.dtype) if gb is not None else None
        return gh, gw, gb, None, None, None, None, None, None, None


def _scatter(values: torch.Tensor, rows: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """``[B, S]`` float32 holding ``values [M]`` at the flat positions ``rows`` (all when None), 0 elsewhere."""
    out = torch.zeros(shape, dtype=torch.float32, device=values.device)
    flat = out.view(-1)
    if rows is None:
        flat.copy_(values)
    else:
        flat.index_copy_(0, rows, values)
    return out


def token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | str = "auto",
    chunk_budget_bytes: int = 512 * 2**20,
    bias: torch.Tensor | None = None,
    entropy: bool = False,
    skip_ignored: bool = True,
    temperature: float = 1.0,
    banned: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logps [B, S], entropies [B, S] or None)`` float32 of the unshifted ``labels [B, S]``.

    Position ``t`` holds the log-prob of ``labels[b, t + 1]`` (the shifted label, HF's
    convention) under the logits divided by ``temperature``, the ``banned`` token ids excluded
    (their logits ``-inf``), and 0 where that label is ignored; equal to :func:`full_token_logps` of
    ``F.linear(hidden, weight, bias)`` in value and gradient. Entropies (of the tempered distribution)
    carry no gradient.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    ban = torch.tensor(sorted(set(banned)), dtype=torch.long, device=hidden.device) if banned else None  # [K]
    shifted = shift_labels(labels)  # [B, S]
    out_of_range = check_inputs(hidden, weight, shifted, chunk_size)
    if out_of_range.any():
        raise_out_of_range(out_of_range, shifted, weight.shape[0], False)
    dtype = compute_dtype(hidden, weight)
    targets = shifted.reshape(-1)  # [N]
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    if temperature != 1.0:  # z / T = (h / T) W^T + b / T: the head never holds a second [V, H] weight
        h, bias = h / temperature, (bias / temperature if bias is not None else None)
    rows = None
    if skip_ignored:
        rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # [M]; one host sync: M sizes the chunks
        if rows.numel() == h.shape[0]:
            rows = None
    n_rows = h.shape[0] if rows is None else rows.numel()
    chunk = auto_chunk_size(n_rows, weight.shape[0], chunk_budget_bytes) if chunk_size == "auto" else chunk_size
    # the head's saved tensors are its inputs, not activations: kept on the device under activation offload
    with torch.autograd.graph.saved_tensors_hooks(keep_on_device, keep_on_device):
        return _ChunkedTokenLogps.apply(h, weight, bias, targets, rows, chunk, dtype, entropy, shifted.shape, ban)


def sequence_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | str = "auto",
    chunk_budget_bytes: int = 512 * 2**20,
    bias: torch.Tensor | None = None,
    skip_ignored: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums [B] float32, counts [B] int64)``: per sequence, the sum and number of label log-probs.

    What preference objectives (DPO and kin) need: ``sums[b] = sum_t log p(labels[b, t+1] | ..t)``
    over the labelled (reply) positions of sequence ``b``, equal to TRL's ``get_batch_logps``
    (:func:`full_sequence_logps`): :func:`token_logps` summed, so its backward is the per-token
    one with the sequence's upstream gradient on each of its tokens.
    """
    logps, _ = token_logps(hidden, weight, labels, chunk_size, chunk_budget_bytes, bias, skip_ignored=skip_ignored)
    return logps.sum(-1), (shift_labels(labels) != IGNORE_INDEX).sum(-1)


def unpack(values: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """``[B, max L]``: a packed row's per-token values ``[1, ΣL]`` laid out as the right-padded batch of its
    samples (sample ``b``'s ``L_b`` values first in row ``b``, 0 after), differentiable. The per-token log-probs
    of a packed row (:func:`token_logps`) so equal the padded batch's position for position: a sample's last
    position predicts the next sample's first label, which the packing ignores (:mod:`qwenkit.data.collator`),
    as a padded row's last position predicts padding."""
    parts = values[0].split(seq_lens.tolist())
    return torch.nn.utils.rnn.pad_sequence(list(parts), batch_first=True)


def full_token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                     banned: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Reference (full logits, TRL's ``selective_log_softmax_and_entropy`` of ``logits / temperature``;
    ``banned`` token ids' logits ``-inf`` first, as HF's ``SuppressTokensLogitsProcessor``):
    ``(logps [B, S], entropies [B, S])``, 0 where the shifted label is ignored."""
    shifted = shift_labels(labels)
    valid = shifted != IGNORE_INDEX
    if banned:
        logits = logits.index_fill(-1, torch.tensor(banned, device=logits.device), -torch.inf)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, S, V]
    logps = logp_all.gather(-1, torch.where(valid, shifted, 0)[..., None]).squeeze(-1)
    # -p log p; a banned token's log p is -inf, clamped to the lowest float: its term is 0 * finite = 0
    ents = -(logp_all.exp() * logp_all.clamp(min=torch.finfo(logp_all.dtype).min)).sum(-1)
    # where, not * valid: an ignored position may gather a banned token's -inf
    return torch.where(valid, logps, 0.0), torch.where(valid, ents, 0.0).detach()


def full_sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (full logits, TRL's ``log_softmax`` gather): ``(sums [B], counts [B])`` of label log-probs."""
    shifted = shift_labels(labels)
    valid = shifted != IGNORE_INDEX
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.where(valid, shifted, 0)[..., None]).squeeze(-1)
    return (logps * valid).sum(-1), valid.sum(-1)


__all__ = ["full_sequence_logps", "full_token_logps", "sequence_logps", "token_logps", "unpack"]
