"""Per-token log-probs (and entropies) of the labels under ``hidden @ weight.T (+ bias)``, without the full logits.

What GRPO needs of a completion: ``logp[b, t] = log softmax(h_t W^T + b)[y_{t+1}]`` at every
labelled position, each weighted separately by the loss (ratios, clipping, KL), and the
policy's entropy there for the metrics. TRL computes both from ``[B, T, V]`` logits (its
``selective_log_softmax`` and ``entropy_from_logits``): at V = 151,936 and 8 completions of
2,048 tokens that is 10 GiB in float32, before the gradient. Here:

1. ``rows = positions whose shifted label != -100``          # the completion tokens
2. per chunk of rows: ``z = h[rows_c] @ W.T (+ b) - max``       # [C, V] float32, the one buffer
3. ``logp = z[y] - log sum exp z``; with ``entropy``, ``H = log S - sum(e^z z) / S`` from a
   second ``[C, V]`` buffer (``e^z``), no grad (TRL logs it detached too)
4. backward: the upstream gradient ``g [B, S]`` becomes :func:`qwenkit.model.loss._chunk_pass`'s
   per-token weights ``-g`` (its loss is ``sum w (-logp)``), which recomputes each chunk and
   returns ``grad_h``, ``grad_W``, ``grad_b``, as :func:`qwenkit.model.loss.sequence_logps` does.

Peak extra memory is that of :func:`qwenkit.model.loss.chunked_linear_cross_entropy` (one chunk
plus the gradients of hidden and weight), and one more chunk buffer while entropies are computed.
The outputs are ``[B, S]`` float32, zero where there is no label.
"""

from __future__ import annotations

import torch

from qwenkit.model.loss import (
    IGNORE_INDEX,
    _autocast_off,
    _check_inputs,
    _keep_on_device,
    _raise_out_of_range,
    auto_chunk_size,
    compute_dtype,
    logp_grads,
    shift_labels,
)  # fmt: skip


def _row_logps_entropy(hidden, weight, bias, targets, rows, chunk, entropy: bool):
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
        valid = y != IGNORE_INDEX
        z.sub_(z.amax(dim=1, keepdim=True))  # in place: z - max, so exp never overflows
        target = z.gather(1, torch.where(valid, y, 0)[:, None]).squeeze(1)  # [C]
        if entropy:
            p = z.exp()  # [C, V] the second buffer: e^z, unnormalised
            sum_exp = p.sum(dim=1)  # [C]
            log_s = sum_exp.log()
            ents[start:end] = torch.where(valid, log_s - p.mul_(z).sum(dim=1) / sum_exp, 0.0)
            del p
        else:
            log_s = z.exp_().sum(dim=1).log()  # in place: the one buffer
        logps[start:end] = torch.where(valid, target - log_s, 0.0)
        del z  # one chunk buffer at a time (see loss._chunk_pass)
    return logps, ents


class _ChunkedTokenLogps(torch.autograd.Function):
    """Per-token label log-probs ``[N]``; backward recomputes each chunk against ``-g`` (module docstring, step 4)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, chunk, dtype, entropy, shape):
        with _autocast_off(hidden.device.type):
            b_c = bias.to(dtype) if bias is not None else None
            row_logps, row_ents = _row_logps_entropy(hidden.to(dtype), weight.to(dtype), b_c, targets, rows, chunk, entropy)
        # [B, S] tensors of their own, not views: FSDP2 warns of a module returning a view (an in-place
        # op on it would skip its backward hook)
        logps = _scatter(row_logps, rows, shape)
        ents = _scatter(row_ents, rows, shape) if entropy else None
        if entropy:
            ctx.mark_non_differentiable(ents)
        ctx.save_for_backward(hidden, weight, bias, targets, rows)
        ctx.chunk, ctx.dtype = chunk, dtype
        return logps, ents

    @staticmethod
    def backward(ctx, grad_logps, _grad_ents):
        hidden, weight, bias, targets, rows = ctx.saved_tensors
        weights = torch.where(targets != IGNORE_INDEX, -grad_logps.float().reshape(-1), 0.0)  # [N]
        return (*logp_grads(ctx, hidden, weight, bias, targets, rows, weights), None, None, None, None, None, None)


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logps [B, S], entropies [B, S] or None)`` float32 of the unshifted ``labels [B, S]``.

    Position ``t`` holds the log-prob of ``labels[b, t + 1]`` (the shifted label, HF's
    convention) and 0 where that label is ignored; equal to :func:`full_token_logps` of
    ``F.linear(hidden, weight, bias)`` in value and gradient. Entropies carry no gradient.
    """
    shifted = shift_labels(labels)  # [B, S]
    out_of_range = _check_inputs(hidden, weight, shifted, chunk_size)
    if out_of_range.any():
        _raise_out_of_range(out_of_range, shifted, weight.shape[0], False)
    dtype = compute_dtype(hidden, weight)
    targets = shifted.reshape(-1)  # [N]
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    rows = None
    if skip_ignored:
        rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)  # [M]; one host sync: M sizes the chunks
        if rows.numel() == h.shape[0]:
            rows = None
    n_rows = h.shape[0] if rows is None else rows.numel()
    chunk = auto_chunk_size(n_rows, weight.shape[0], chunk_budget_bytes) if chunk_size == "auto" else chunk_size
    with torch.autograd.graph.saved_tensors_hooks(_keep_on_device, _keep_on_device):
        return _ChunkedTokenLogps.apply(h, weight, bias, targets, rows, chunk, dtype, entropy, shifted.shape)


def full_token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference (full logits, TRL's ``selective_log_softmax`` and ``entropy_from_logits``):
    ``(logps [B, S], entropies [B, S])``, 0 where the shifted label is ignored."""
    shifted = shift_labels(labels)
    valid = shifted != IGNORE_INDEX
    logp_all = torch.log_softmax(logits.float(), dim=-1)  # [B, S, V]
    logps = logp_all.gather(-1, torch.where(valid, shifted, 0)[..., None]).squeeze(-1)
    ents = -(logp_all.exp() * logp_all).sum(-1)
    return logps * valid, (ents * valid).detach()


__all__ = ["full_token_logps", "token_logps"]
