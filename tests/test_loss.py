"""Chunked linear cross-entropy vs full-logits references (HF's own ForCausalLMLoss first)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss

from qwenkit.loss import (
    IGNORE_INDEX,
    auto_chunk_size,
    chunked_linear_cross_entropy,
    full_cross_entropy,
)

# fp32: both sides do the same math in a different summation order; errors stay ~1e-7 relative.
FP32 = dict(rtol=1e-5, atol=1e-6)


def _inputs(b=3, s=37, h=48, v=211, ignore_frac=0.3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.2).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[torch.rand(b, s, generator=g) < ignore_frac] = IGNORE_INDEX
    return hidden, weight, labels


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk", [37, 16, 5, 1000, "auto"])  # divides B*S, does not, exceeds
def test_token_mean_equals_hf_for_causal_lm_loss(chunk):
    hidden, weight, labels = _inputs()
    ref = ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0])
    got = chunked_linear_cross_entropy(hidden, weight, labels, "token_mean", chunk_size=chunk)
    torch.testing.assert_close(got, ref, **FP32)
    for a, b in zip(_grads(got, hidden, weight), _grads(ref, hidden, weight)):
        torch.testing.assert_close(a, b, **FP32)


def test_token_mean_with_global_count_equals_hf_num_items_in_batch():
    hidden, weight, labels = _inputs()
    ref = ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0], num_items_in_batch=torch.tensor(500))
    got = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=8, num_items_in_batch=torch.tensor(500))
    torch.testing.assert_close(got, ref, **FP32)


@pytest.mark.parametrize("chunk", [16, 111, 4096])
def test_sample_mean_equals_reference(chunk):
    hidden, weight, labels = _inputs(seed=3)
    ref = full_cross_entropy(hidden @ weight.T, labels, "sample_mean")
    # the reference by hand: mean over samples of each sample's token mean
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    by_hand = torch.stack(
        [
            torch.nn.functional.cross_entropy(hidden[i] @ weight.T, shifted[i], ignore_index=IGNORE_INDEX)
            for i in range(labels.shape[0])
        ]
    ).mean()
    torch.testing.assert_close(ref, by_hand, **FP32)
    got = chunked_linear_cross_entropy(hidden, weight, labels, "sample_mean", chunk_size=chunk)
    torch.testing.assert_close(got, ref, **FP32)
    for a, b in zip(_grads(got, hidden, weight), _grads(ref, hidden, weight)):
        torch.testing.assert_close(a, b, **FP32)


def test_chunks_of_only_ignored_labels_cost_no_nan():
    hidden, weight, labels = _inputs(b=2, s=32)
    labels[0] = IGNORE_INDEX  # the whole first row: chunks of 16 see nothing valid
    got = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=16)
    ref = ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0])
    torch.testing.assert_close(got, ref, **FP32)
    gh, gw = _grads(got, hidden, weight)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert gh[0].abs().max() == 0  # ignored positions get no gradient


def test_all_ignored_batch_gives_zero_loss_and_grads():
    hidden, weight, labels = _inputs(b=2, s=8)
    labels[:] = IGNORE_INDEX
    for reduction in ("token_mean", "sample_mean"):
        got = chunked_linear_cross_entropy(hidden, weight, labels, reduction, chunk_size=4)
        assert got.item() == 0.0
        gh, gw = _grads(got, hidden, weight)
        assert gh.abs().max() == 0 and gw.abs().max() == 0


def test_bf16_matches_hf_within_bf16_rounding():
    """bf16 logits are upcast as HF does; the gradient of W is summed over chunks in fp32, so the
    two differ by bf16 rounding of per-chunk partial products (eps_bf16 = 2^-8 ≈ 4e-3)."""
    hidden, weight, labels = _inputs(dtype=torch.bfloat16, h=64, v=300)
    ref = ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0])
    got = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=16)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # loss is accumulated in fp32 both ways
    for a, b in zip(_grads(got, hidden, weight), _grads(ref, hidden, weight)):
        assert a.dtype == b.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)


def test_gradient_accumulation_and_data_parallel_splits_agree():
    """token_mean with the global count: 1 x batch-4 == 2 x 2 == 4 x 1, loss and gradients."""
    hidden, weight, labels = _inputs(b=4, s=21, seed=7)
    total = (torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:] != IGNORE_INDEX).sum()
    results = []
    for parts in (1, 2, 4):
        loss = sum(
            chunked_linear_cross_entropy(h, weight, y, chunk_size=8, num_items_in_batch=total)
            for h, y in zip(hidden.chunk(parts), labels.chunk(parts))
        )
        results.append((loss, *_grads(loss, hidden, weight)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, **FP32)


def test_sample_mean_splits_agree_with_global_sample_count():
    hidden, weight, labels = _inputs(b=4, s=21, seed=8)
    whole = chunked_linear_cross_entropy(hidden, weight, labels, "sample_mean", chunk_size=8)
    split = sum(
        chunked_linear_cross_entropy(h, weight, y, "sample_mean", chunk_size=8, num_samples=4)
        for h, y in zip(hidden.chunk(2), labels.chunk(2))
    )
    torch.testing.assert_close(whole, split, **FP32)


class _LargestOutputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_no_full_logits_tensor_in_forward_or_backward():
    b, s, h, v, chunk = 2, 64, 16, 500, 8
    hidden, weight, labels = _inputs(b=b, s=s, h=h, v=v)
    with _LargestOutputs() as seen:
        loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
        loss.backward()
    # weight-sized tensors (W, W.T, grad W) are [V, H]; everything else with a V dim is logits-like
    vocab_sized = [shape for shape in seen.shapes if v in shape and sorted(shape) != sorted((v, h))]
    assert vocab_sized, "the probe saw no logits chunk at all"
    assert max(torch.Size(sh).numel() for sh in vocab_sized) <= chunk * v


def test_auto_chunk_size_respects_the_budget():
    assert auto_chunk_size(10_000, 151_936, 512 * 2**20) == 832  # 883 rows fit, rounded to 64
    assert auto_chunk_size(100, 151_936, 512 * 2**20) == 100  # never more than the tokens
    assert auto_chunk_size(10_000, 151_936, 1) == 64  # at least one multiple


def test_bad_arguments_raise_clear_errors():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="chunk_size must be a positive int or 'auto', got 0"):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="loss reduction must be one of"):
        chunked_linear_cross_entropy(hidden, weight, labels, "sum")
    with pytest.raises(ValueError, match="disagree"):
        chunked_linear_cross_entropy(hidden, weight, labels[:, :-1])


def test_peak_memory_is_one_chunk_above_the_gradients():
    """In a fresh process: the head's whole transient is grad W + grad h + ONE logits chunk.

    Sized so a chunk (62.5 MiB) is mmapped and returned to the OS when freed; holding two
    chunks at once (the old buffer alive while the next one is allocated) fails this.
    """
    from qwenkit.notebooks.measure import head_case, head_measure

    n, h, v, chunk = 2048, 64, 32_000, 512
    row = head_measure(head_case(str(chunk), n, h, v))
    mib = 2**20
    floor = (v * h * 4 + n * h * 4 + chunk * v * 4) / mib
    assert floor * 0.9 < row["peak_mb"] < floor + 0.5 * chunk * v * 4 / mib
