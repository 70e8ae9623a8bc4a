"""Chunked linear cross-entropy: the loss of ``hidden @ weight.T (+ bias)`` without the full logits.

HF's loss head materialises ``logits [N, V]`` in forward, a float32 copy and a log-softmax of
the same size, and their gradient in backward: about 3 x N x V x 4 bytes at once. For
Qwen2.5-VL (V = 151,936) and N = 4096 tokens that is ~7.5 GiB. Here only the rows that carry a
label are projected, ``chunk`` rows at a time, and everything backward needs is computed in the
same pass:

0. ``rows = positions whose shifted label != -100``  # in VL SFT often 50-90% are ignored
1. ``logits = h[rows_c] @ W.T (+ b)``       # [C, V], the only chunk-sized buffer
2. ``lse = log(sum(exp(logits - max))) + max``, done in place on that buffer
3. ``loss_c = sum(w_i * (lse_i - logits[i, y_i]))`` with per-token weights ``w`` (the reduction)
4. the buffer becomes ``dlogits = w * (softmax - onehot(y))`` in place
5. ``grad_h[rows_c] = dlogits @ W``, ``grad_W += dlogits.T @ h[rows_c]``, ``grad_b += dlogits.sum(0)``

Ignored positions have weight 0, so skipping them changes no loss and no gradient: their rows
of ``grad_h`` are zero. Backward only scales the stored gradients by the incoming gradient.
Peak extra memory is one ``[C, V]`` float32 chunk plus ``grad_h [N, H]`` and ``grad_W [V, H]``
float32 (1.16 GiB at Qwen2.5-VL-3B sizes, 2.2 GiB at 7B; it exists in any loss implementation:
it is the weight's gradient). Without grad (evaluation) only the loss is computed: no gradient
matmul and no gradient buffer.

Loss types (their reductions) are expressed as per-token weights, so one kernel serves them all:
``token_mean``: ``w = 1 / num_items`` (valid tokens of the *global* batch when given), and
``sample_mean``: ``w = 1 / (valid tokens of the sample * number of samples)``, and evaluation's
``token_sum``: ``w = 1``.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from qwenkit.config import LOSS_TYPES, TRAINING_LOSS_TYPES, chunk_size_problem

IGNORE_INDEX = -100  # label of a position the loss skips (HF's and torch's convention)
# Evaluation's loss type, passed per call (never a model's or a run's loss.loss_type): the sum of
# the token losses, which the evaluator divides by the label tokens of the whole eval set.
TOKEN_SUM = "token_sum"
# chunk_size=auto rounds chunks to this many rows: GEMM tiles on CPU (oneDNN/MKL) and GPU/NPU
# (tensor-core tiles) are powers of two up to 128/256; see benchmarks/chunk_loss.py for the sweep.
CHUNK_MULTIPLE = 128


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Position t predicts label t+1 (HF's convention); the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # [B, S]


def token_weights(
    shifted: torch.Tensor,
    loss_type: str,
    num_items_in_batch: int | torch.Tensor | None = None,
    num_samples: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token weights [B, S] realising a loss type (its reduction); ignored positions weigh 0.

    ``num_items_in_batch``: valid tokens of the global batch (all ranks, all accumulation
    micro-batches) for ``token_mean``; ``num_samples``: samples of the global batch for
    ``sample_mean``. When omitted, this batch's own counts are used.
    """
    valid = shifted != ignore_index  # [B, S]
    if loss_type == "token_mean":
        n = valid.sum() if num_items_in_batch is None else num_items_in_batch
        return valid / torch.as_tensor(n, dtype=torch.float32, device=valid.device).clamp(min=1)
    if loss_type == "sample_mean":
        per_sample = valid.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        b = valid.shape[0] if num_samples is None else num_samples
        return valid / (per_sample * b)
    if loss_type == TOKEN_SUM:
        return valid.float()
    raise ValueError(f"loss_type must be one of {(*TRAINING_LOSS_TYPES, TOKEN_SUM)}, got {loss_type!r}")


def auto_chunk_size(num_rows: int, vocab_size: int, budget_bytes: int, multiple: int = CHUNK_MULTIPLE) -> int:
    """Rows per chunk for ``num_rows`` projected (labelled) rows: equal chunks, matmul-friendly.

    The fewest chunks whose float32 ``[chunk, V]`` buffer fits ``budget_bytes``, split evenly
    (no thin last chunk) and rounded up to ``multiple`` rows, never above the budget's largest
    multiple (at least one multiple).
    """
    cap = max(multiple, budget_bytes // (vocab_size * 4) // multiple * multiple)
    if num_rows <= 0:
        return cap
    even = math.ceil(num_rows / math.ceil(num_rows / cap))
    return min(cap, math.ceil(even / multiple) * multiple)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` would compute in: autocast's, or the common one.

    Under autocast F.linear casts both operands (an fp32 head weight with bf16 activations is
    the usual mix); outside it F.linear refuses mixed dtypes, and so does this head.
    """
    device_type = hidden.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if hidden.dtype != weight.dtype:
        raise RuntimeError(
            f"lm_head: hidden states are {hidden.dtype} but the weight is {weight.dtype}; F.linear (HF's head) "
            "refuses this mix outside autocast as well: cast the model to one dtype or run under torch.autocast"
        )
    return weight.dtype


def chunk_pass(hidden, weight, bias, targets, weights, rows, chunk, need_h, need_w, need_b, banned=None):
    """Loss, and the gradients asked for, of the rows ``rows`` (all rows when None).

    hidden [N, H], weight [V, H], bias [V] or None, all in the compute dtype; targets [N];
    weights [N] float32; rows [M] int64 indices or None; banned [K] int64 token ids whose logits are
    -inf (the softmax is over the other tokens, as a sampler that never draws them) or None. Returns
    (loss, grad_h [N, H] or None, grad_w [V, H] float32 or None, grad_b [V] float32 or None).
    """
    n_rows = hidden.shape[0] if rows is None else rows.numel()
    grad_h = None
    if need_h:
        # skipped rows get zero gradient; with every row projected each one is written once
        grad_h = torch.empty_like(hidden) if rows is None else torch.zeros_like(hidden)  # [N, H]
    # grad W is written by the first chunk and accumulated by the others: no zero-fill pass
    # over [V, H] (1.16 GiB at Qwen2.5-VL-3B sizes); zeros only when there is no chunk at all
    alloc = torch.empty if n_rows > 0 else torch.zeros
    grad_w = alloc(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        if rows is None:
            h, y, w = hidden[start:end], targets[start:end], weights[start:end]  # [C, H], [C], [C]
        else:
            idx = rows[start:end]  # [C]
            h, y, w = hidden.index_select(0, idx), targets[idx], weights[idx]
        logits = (h @ weight.T).float()  # [C, V]; a no-op cast in fp32, HF's upcast in bf16
        if bias is not None:
            logits += bias
        if banned is not None:
            logits.index_fill_(1, banned, -torch.inf)  # exp gives 0: no mass, no gradient
        valid = y != IGNORE_INDEX  # all True for gathered rows; the dense path keeps ignored ones
        y_safe = torch.where(valid, y, 0)
        target_logit = logits.gather(1, y_safe[:, None]).squeeze(1)  # [C]
        row_max = logits.amax(dim=1, keepdim=True)  # [C, 1]
        logits.sub_(row_max).exp_()  # in place: exp(logits - max)
        sum_exp = logits.sum(dim=1, keepdim=True)  # [C, 1]
        lse = sum_exp.log().squeeze(1) + row_max.squeeze(1)  # [C]
        # where(): an ignored token has w = 0 and adds exactly 0, never 0 * NaN
        loss += torch.where(valid, w * (lse - target_logit), 0.0).sum()
        if need_h or need_w or need_b:
            # dL/dlogits = w * (softmax - onehot), built in the same buffer
            logits.mul_((w / sum_exp.squeeze(1))[:, None])
            logits[torch.arange(end - start, device=y.device), y_safe] -= torch.where(valid, w, 0.0)
            if need_b:
                grad_b += logits.sum(0)  # bias gradient from the fp32 buffer
            dlogits = logits.to(hidden.dtype)  # no copy in fp32
            if need_h and rows is None:
                torch.mm(dlogits, weight, out=grad_h[start:end])
            elif need_h:
                grad_h.index_copy_(0, idx, dlogits @ weight)  # [C, H] scattered back to its positions
            if need_w and dlogits.dtype == torch.float32:
                if start == 0:
                    torch.mm(dlogits.T, h, out=grad_w)  # [V, H]
                else:
                    grad_w.addmm_(dlogits.T, h)  # accumulated in place
            elif need_w:
                part = dlogits.T @ h  # low-precision GEMM as HF's, summed over chunks in fp32
                if start == 0:
                    grad_w.copy_(part)
                else:
                    grad_w.add_(part)
            del dlogits
        # Free this chunk's buffer now: rebinding `logits` in the next iteration would allocate
        # the next [C, V] while this one is still referenced (two chunks at peak, not one).
        del logits
    return loss, grad_h, grad_w, grad_b


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, weights, rows, chunk, dtype):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with autocast_off(hidden.device.type):  # operands are cast to `dtype` here, as autocast would
            w_c = weight.to(dtype)  # no copy when the dtypes agree
            b_c = bias.to(dtype) if bias is not None else None
            loss, grad_h, grad_w, grad_b = chunk_pass(
                hidden.to(dtype), w_c, b_c, targets, weights, rows, chunk, need_h, need_w, need_b
            )
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        # Scale in place: a second [V, H] buffer here would double the weight-gradient memory.
        # (These buffers belong to this node alone; backward runs once without retain_graph.)
        gh = grad_h.mul_(grad_loss.to(grad_h.dtype)).to(h_dtype) if grad_h is not None else None
        gw = grad_w.mul_(grad_loss).to(w_dtype) if grad_w is not None else None
        gb = grad_b.mul_(grad_loss).to(b_dtype) if grad_b is not None else None
        return gh, gw, gb, None, None, None, None, None


def autocast_off(device_type: str):
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def keep_on_device(t: torch.Tensor) -> torch.Tensor:
    return t


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, shifted: torch.Tensor, chunk_size) -> torch.Tensor:
    """The shape and chunk-size checks every chunked head makes; the labels outside the vocabulary [B, S]."""
    if hidden.shape[:-1] != shifted.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and labels {tuple(shifted.shape)} disagree")
    if problem := chunk_size_problem(chunk_size):
        raise ValueError(problem)
    return (shifted != IGNORE_INDEX) & ((shifted < 0) | (shifted >= weight.shape[0]))


def raise_out_of_range(bad: torch.Tensor, shifted: torch.Tensor, vocab: int, given_shifted: bool) -> None:
    """The error F.cross_entropy (HF's loss) raises, with where the bad label sits."""
    where = tuple(bad.nonzero()[0].tolist())  # the first bad position, [b, s]
    value = int(shifted[where])
    if given_shifted:
        at = f"shift_labels[{', '.join(map(str, where))}]"
    else:  # position s predicts labels[..., s + 1]
        at = f"labels[{', '.join(map(str, (*where[:-1], where[-1] + 1)))}]"
    raise IndexError(
        f"Target {value} is out of bounds: {at} = {value} ({int(bad.sum())} such labels), but the vocabulary has "
        f"{vocab} tokens; a label must be in [0, {vocab}) or {IGNORE_INDEX} (ignored)"
    )


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_type: str = "token_mean",
    chunk_size: int | str = "auto",
    chunk_budget_bytes: int = 512 * 2**20,
    num_items_in_batch: int | torch.Tensor | None = None,
    num_samples: int | torch.Tensor | None = None,
    shifted: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    skip_ignored: bool = True,
) -> torch.Tensor:
    """Causal-LM loss of ``hidden [B, S, H]`` (``@ weight.T + bias``) against unshifted ``labels [B, S]``.

    Equal to HF's ``ForCausalLMLoss(lm_head(hidden), labels)`` (``token_mean``, with
    ``num_items_in_batch`` giving the global normaliser) in value and in every gradient.
    ``shifted``: labels already shifted (HF's ``shift_labels``, as sequence parallelism passes
    them, each rank holding a slice); used as given, and ``labels`` is then not read.
    ``skip_ignored=False`` projects every position (the head before ignored rows were skipped;
    kept for benchmarks and as a reference); the result is the same either way.
    """
    given_shifted = shifted is not None
    if shifted is None:
        shifted = shift_labels(labels)  # [B, S]
    out_of_range = check_inputs(hidden, weight, shifted, chunk_size)  # [B, S]
    dtype = compute_dtype(hidden, weight)
    weights = token_weights(shifted, loss_type, num_items_in_batch, num_samples).reshape(-1).float()  # [N]
    shifted = shifted.reshape(-1)  # [N]
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    rows = None
    if skip_ignored:
        rows = (shifted != IGNORE_INDEX).nonzero().squeeze(1)  # [M]; one host sync: M sizes the chunks
        if rows.numel() == h.shape[0]:
            rows = None  # every row labelled: contiguous slices, no gather
    # Once per call, not per chunk: after the nonzero's sync only this reduction is queued, so the
    # second sync waits for nothing else. A bad id would otherwise fail inside a chunk's gather
    # with a bare "index 99 is out of bounds" (CPU) or a device-side assert (CUDA).
    if out_of_range.any():
        raise_out_of_range(out_of_range, shifted.view(out_of_range.shape), weight.shape[0], given_shifted)
    n_rows = h.shape[0] if rows is None else rows.numel()
    chunk = auto_chunk_size(n_rows, weight.shape[0], chunk_budget_bytes) if chunk_size == "auto" else chunk_size
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or
                                         (bias is not None and bias.requires_grad))):  # fmt: skip
        # evaluation: the loss alone, no gradient matmuls and no [V, H] gradient buffer
        with torch.no_grad(), autocast_off(h.device.type):
            b_c = bias.to(dtype) if bias is not None else None
            return chunk_pass(h.to(dtype), weight.to(dtype), b_c, shifted, weights, rows, chunk, False, False, False)[0]
    # The head's saved tensors are its finished gradients (grad W alone is 1.16 GiB in fp32 at 3B),
    # not activations: identity hooks keep them on the device under activation offload (save_on_cpu).
    with torch.autograd.graph.saved_tensors_hooks(keep_on_device, keep_on_device):
        return _ChunkedLinearCrossEntropy.apply(h, weight, bias, shifted, weights, rows, chunk, dtype)


def full_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_type: str = "token_mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    num_samples: int | torch.Tensor | None = None,
    shifted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference (full logits) loss for every loss type, incl. ``raw`` (per-token, [B, S]).

    ``shifted``: pre-shifted labels (HF's ``shift_labels``), used instead of shifting ``labels``.
    """
    if shifted is None:
        shifted = shift_labels(labels)
    per_token = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(shifted.shape)  # [B, S]
    if loss_type == "raw":
        return per_token
    return (per_token * token_weights(shifted, loss_type, num_items_in_batch, num_samples)).sum()


__all__ = [
    "CHUNK_MULTIPLE",
    "IGNORE_INDEX",
    "LOSS_TYPES",
    "TOKEN_SUM",
    "TRAINING_LOSS_TYPES",
    "auto_chunk_size",
    "chunked_linear_cross_entropy",
    "compute_dtype",
    "autocast_off",
    "check_inputs",
    "chunk_pass",
    "full_cross_entropy",
    "keep_on_device",
    "raise_out_of_range",
    "shift_labels",
    "token_weights",
]
