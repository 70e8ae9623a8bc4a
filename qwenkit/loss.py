"""Chunked linear cross-entropy: the loss of ``hidden @ weight.T`` without the full logits.

HF's loss head materialises ``logits [N, V]`` in forward, a float32 copy and a log-softmax of
the same size, and their gradient in backward: about 3 x N x V x 4 bytes at once. For
Qwen2.5-VL (V = 151,936) and N = 4096 tokens that is ~7.5 GiB. Here the tokens are processed
``chunk`` rows at a time, and everything backward needs is computed in the same pass:

1. ``logits = h_c @ W.T``                   # [C, V], the only chunk-sized buffer
2. ``lse = log(sum(exp(logits - max))) + max``, done in place on that buffer
3. ``loss_c = sum(w_i * (lse_i - logits[i, y_i]))`` with per-token weights ``w`` (the reduction)
4. the buffer becomes ``dlogits = w * (softmax - onehot(y))`` in place
5. ``grad_h[c] = dlogits @ W`` and ``grad_W += dlogits.T @ h_c``

Backward only scales the stored ``grad_h`` and ``grad_W`` by the incoming gradient. Peak extra
memory is one ``[C, V]`` float32 chunk plus ``grad_h [N, H]`` and ``grad_W [V, H]`` (the latter
exists in any loss implementation: it is the weight's gradient).

Reductions are expressed as per-token weights, so one kernel serves them all:
``token_mean``: ``w = 1 / num_items`` (valid tokens of the *global* batch when given), and
``sample_mean``: ``w = 1 / (valid tokens of the sample * number of samples)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # label of a position the loss skips (HF's and torch's convention)
REDUCTIONS = ("token_mean", "sample_mean")  # what the chunked head computes
LOSS_TYPES = (*REDUCTIONS, "raw")  # loss.loss_type; raw (unreduced, per token): an API output, not for training


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Position t predicts label t+1 (HF's convention); the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # [B, S]


def token_weights(
    shifted: torch.Tensor,
    reduction: str,
    num_items_in_batch: int | torch.Tensor | None = None,
    num_samples: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Per-token weights [B, S] realising a reduction; ignored positions weigh 0.

    ``num_items_in_batch``: valid tokens of the global batch (all ranks, all accumulation
    micro-batches) for ``token_mean``; ``num_samples``: samples of the global batch for
    ``sample_mean``. When omitted, this batch's own counts are used.
    """
    valid = shifted != ignore_index  # [B, S]
    if reduction == "token_mean":
        n = valid.sum() if num_items_in_batch is None else num_items_in_batch
        return valid / torch.as_tensor(n, dtype=torch.float32, device=valid.device).clamp(min=1)
    if reduction == "sample_mean":
        per_sample = valid.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        b = valid.shape[0] if num_samples is None else num_samples
        return valid / (per_sample * b)
    raise ValueError(f"loss reduction must be one of {REDUCTIONS}, got {reduction!r}")


def auto_chunk_size(num_tokens: int, vocab_size: int, budget_bytes: int, multiple: int = 64) -> int:
    """Largest multiple of ``multiple`` whose float32 [chunk, V] buffer fits ``budget_bytes``."""
    rows = budget_bytes // (vocab_size * 4)
    rows = max(multiple, rows // multiple * multiple)
    return min(rows, max(num_tokens, 1))


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, weights, chunk_size):
        # hidden [N, H], weight [V, H], targets [N] (ignore_index allowed), weights [N] float32
        n = hidden.shape[0]
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None  # [N, H]
        # grad W is written by the first chunk and accumulated by the others: no zero-fill pass
        # over [V, H] (0.58 GiB at Qwen2.5-VL-3B sizes); zeros only when there is no chunk at all
        alloc = torch.empty if n > 0 else torch.zeros
        grad_w = alloc(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            h = hidden[start:end]  # [C, H]
            y = targets[start:end]  # [C]
            w = weights[start:end]  # [C]
            logits = (h @ weight.T).float()  # [C, V]; a no-op cast in fp32, HF's upcast in bf16
            valid = y != IGNORE_INDEX
            y_safe = torch.where(valid, y, 0)
            target_logit = logits.gather(1, y_safe[:, None]).squeeze(1)  # [C]
            row_max = logits.amax(dim=1, keepdim=True)  # [C, 1]
            logits.sub_(row_max).exp_()  # in place: exp(logits - max)
            sum_exp = logits.sum(dim=1, keepdim=True)  # [C, 1]
            lse = sum_exp.log().squeeze(1) + row_max.squeeze(1)  # [C]
            # where(): a chunk of ignored tokens has w = 0 and adds exactly 0, never 0 * NaN
            loss += torch.where(valid, w * (lse - target_logit), 0.0).sum()
            if need_h or need_w:
                # dL/dlogits = w * (softmax - onehot), built in the same buffer
                logits.mul_((w / sum_exp.squeeze(1))[:, None])
                logits[torch.arange(end - start, device=y.device), y_safe] -= torch.where(valid, w, 0.0)
                dlogits = logits.to(hidden.dtype)  # no copy in fp32
                if need_h:
                    torch.mm(dlogits, weight, out=grad_h[start:end])
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
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        # Scale in place: a second [V, H] buffer here would double the weight-gradient memory.
        # (These buffers belong to this node alone; backward runs once without retain_graph.)
        gh = grad_h.mul_(grad_loss.to(grad_h.dtype)) if grad_h is not None else None
        gw = grad_w.mul_(grad_loss).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    reduction: str = "token_mean",
    chunk_size: int | str = "auto",
    chunk_budget_bytes: int = 512 * 2**20,
    num_items_in_batch: int | torch.Tensor | None = None,
    num_samples: int | torch.Tensor | None = None,
    shifted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal-LM loss of ``hidden [B, S, H]`` against unshifted ``labels [B, S]``.

    Equal to HF's ``ForCausalLMLoss(lm_head(hidden), labels)`` (``token_mean``, with
    ``num_items_in_batch`` giving the global normaliser) in value and in every gradient.
    ``shifted``: labels already shifted (HF's ``shift_labels``, as sequence parallelism passes
    them, each rank holding a slice); used as given, and ``labels`` is then not read.
    """
    if shifted is None:
        shifted = shift_labels(labels)  # [B, S]
    if hidden.shape[:-1] != shifted.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and labels {tuple(shifted.shape)} disagree")
    weights = token_weights(shifted, reduction, num_items_in_batch, num_samples).reshape(-1).float()
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    if chunk_size == "auto":
        chunk = auto_chunk_size(h.shape[0], weight.shape[0], chunk_budget_bytes)
    elif isinstance(chunk_size, int) and chunk_size > 0:
        chunk = chunk_size
    else:
        raise ValueError(f"chunk_size must be a positive int or 'auto', got {chunk_size!r}")
    return _ChunkedLinearCrossEntropy.apply(h, weight, shifted.reshape(-1), weights, chunk)


def full_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    reduction: str = "token_mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    num_samples: int | torch.Tensor | None = None,
    shifted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference (full logits) loss for every reduction, incl. ``raw`` (per-token, [B, S]).

    ``shifted``: pre-shifted labels (HF's ``shift_labels``), used instead of shifting ``labels``.
    """
    if shifted is None:
        shifted = shift_labels(labels)
    per_token = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(shifted.shape)  # [B, S]
    if reduction == "raw":
        return per_token
    return (per_token * token_weights(shifted, reduction, num_items_in_batch, num_samples)).sum()


__all__ = [
    "IGNORE_INDEX",
    "LOSS_TYPES",
    "REDUCTIONS",
    "auto_chunk_size",
    "chunked_linear_cross_entropy",
    "full_cross_entropy",
    "shift_labels",
    "token_weights",
]
