"""Chunked linear cross-entropy vs full-logits references (HF's own ForCausalLMLoss first)."""

import math

import pytest
import torch
from conftest import EVERY_FAMILY
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss

from qwenkit.model.losses.cross_entropy import (
    CHUNK_MULTIPLE,
    IGNORE_INDEX,
    auto_chunk_size,
    chunked_linear_cross_entropy,
    full_cross_entropy,
)
from qwenkit.model.losses.logps import full_sequence_logps, sequence_logps

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
    for loss_type in ("token_mean", "sample_mean"):
        got = chunked_linear_cross_entropy(hidden, weight, labels, loss_type, chunk_size=4)
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


def test_auto_chunk_size_fits_the_budget_in_even_matmul_friendly_chunks():
    v, budget = 151_936, 512 * 2**20
    cap = budget // (v * 4) // CHUNK_MULTIPLE * CHUNK_MULTIPLE  # largest multiple within the budget
    for rows in (1, 100, 200, 883, 990, 2047, 4096, 10_000):
        c = auto_chunk_size(rows, v, budget)
        assert c % CHUNK_MULTIPLE == 0 and c * v * 4 <= budget, (rows, c)
        assert math.ceil(rows / c) == math.ceil(rows / cap), (rows, c)  # no more chunks than needed
    assert auto_chunk_size(990, v, budget) == 512  # two even chunks (512 + 478), not 768 + a thin 222
    assert auto_chunk_size(10, v, 1) == CHUNK_MULTIPLE  # at least one multiple


def test_bad_arguments_raise_clear_errors():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="chunk_size must be a positive int or 'auto', got 0"):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        chunked_linear_cross_entropy(hidden, weight, labels, "sum")
    with pytest.raises(ValueError, match="disagree"):
        chunked_linear_cross_entropy(hidden, weight, labels[:, :-1])


def test_peak_memory_is_one_chunk_above_the_gradients():
    """In a fresh process: the head's whole transient is grad W + grad h + ONE logits chunk.

    Sized so a chunk (62.5 MiB) is mmapped and returned to the OS when freed; holding two
    chunks at once (the old buffer alive while the next one is allocated) fails this.
    """
    from qwenkit.bench.measure import head_case, head_measure

    n, h, v, chunk = 2048, 64, 32_000, 512
    [row] = head_measure(head_case(str(chunk), n, h, v))
    mib = 2**20
    floor = (v * h * 4 + n * h * 4 + chunk * v * 4) / mib
    assert floor * 0.9 < row["peak_mb"] < floor + 0.5 * chunk * v * 4 / mib


# ---------------------------------------------------------------------------------------------
# Only labelled rows are projected (issue 17)


class _HeadMatmuls(TorchDispatchMode):
    """Records every matmul touching the vocabulary dim V: (op, rows of the [rows, V] side)."""

    MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default,
               torch.ops.aten.mm.out, torch.ops.aten.bmm.default,
               torch.ops.aten.matmul.default}  # fmt: skip  (inference mode does not decompose matmul)

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.calls = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.MATMULS:
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            if any(self.vocab in s for s in shapes):
                self.calls.append((func, shapes))
        return out


def _with_ignored(labels, frac, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = labels.clone()
    labels[torch.rand(labels.shape, generator=g) < frac] = IGNORE_INDEX
    if frac >= 1:
        labels[:] = IGNORE_INDEX
    return labels


def _valid(labels):
    return int((torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:] != IGNORE_INDEX).sum())


@pytest.mark.parametrize("loss_type", ["token_mean", "sample_mean"])
@pytest.mark.parametrize("frac", [0.0, 0.5, 0.9, 1.0])
def test_skipping_ignored_rows_keeps_loss_and_grads(frac, loss_type):
    hidden, weight, labels = _inputs(b=3, s=40, ignore_frac=0.0, seed=11)
    labels = _with_ignored(labels, frac, seed=12)
    ref = full_cross_entropy(hidden @ weight.T, labels, loss_type)
    if loss_type == "token_mean" and frac < 1:  # and HF's own loss (0 / 0 = NaN without labels; ours is 0)
        torch.testing.assert_close(ref, ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0]), **FP32)
    ref_grads = _grads(ref, hidden, weight)
    for chunk in (7, 16, "auto"):
        got = chunked_linear_cross_entropy(hidden, weight, labels, loss_type, chunk_size=chunk)
        torch.testing.assert_close(got, ref, **FP32)
        for a, b in zip(_grads(got, hidden, weight), ref_grads):
            torch.testing.assert_close(a, b, **FP32)


def test_ignored_runs_on_chunk_boundaries():
    """Runs of ignored labels that start and end exactly where a chunk of labelled rows would."""
    hidden, weight, labels = _inputs(b=2, s=48, ignore_frac=0.0, seed=13)
    labels[0, 1:9] = IGNORE_INDEX  # shifted positions 0..7: the first chunk of 8 of the dense path
    labels[0, 17:33] = IGNORE_INDEX  # two whole chunks
    labels[1, 40:] = IGNORE_INDEX  # the tail of the second row and the first position of nothing
    labels[1, 1] = IGNORE_INDEX  # a single hole
    ref = ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0])
    rh, rw = _grads(ref, hidden, weight)
    for chunk in (8, 4, 1, 5):
        got = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
        torch.testing.assert_close(got, ref, **FP32)
        gh, gw = _grads(got, hidden, weight)
        torch.testing.assert_close(gh, rh, **FP32)
        torch.testing.assert_close(gw, rw, **FP32)
        assert gh[0, :8].abs().max() == 0 and gh[1, 39:].abs().max() == 0


@pytest.mark.parametrize("frac", [0.0, 0.5, 0.9])
def test_head_matmuls_follow_the_labelled_tokens(frac):
    """Forward projects exactly the labelled rows, chunk by chunk; backward adds two GEMMs a chunk."""
    b, s, h, v, chunk = 2, 64, 16, 501, 8
    hidden, weight, labels = _inputs(b=b, s=s, h=h, v=v, ignore_frac=0.0, seed=14)
    labels = _with_ignored(labels, frac, seed=15)
    m = _valid(labels)
    with _HeadMatmuls(v) as seen:
        loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
        loss.backward()
    chunks = -(-m // chunk)
    assert len(seen.calls) == 3 * chunks  # logits, grad h, grad W
    projected = sum(shapes[0][0] for func, shapes in seen.calls if shapes[-1][0] == h and shapes[0][-1] == h
                    and func == torch.ops.aten.mm.default and shapes[-1][-1] == v)  # fmt: skip
    assert projected == m


def test_a_batch_without_labels_projects_nothing():
    hidden, weight, labels = _inputs(b=2, s=16, h=16, v=301)
    labels[:] = IGNORE_INDEX
    for loss_type in ("token_mean", "sample_mean"):
        with _HeadMatmuls(301) as seen:
            got = chunked_linear_cross_entropy(hidden, weight, labels, loss_type, chunk_size=4)
            gh, gw = _grads(got, hidden, weight)
        assert seen.calls == []
        assert got.item() == 0.0 and gh.abs().max() == 0 and gw.abs().max() == 0


def test_all_labelled_rows_use_the_dense_slices():
    """Every shifted position labelled (one sample, last position has no target): gather or not, same."""
    hidden, weight, labels = _inputs(b=1, s=33, ignore_frac=0.0, seed=16)
    dense = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=8, skip_ignored=False)
    skip = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=8)
    torch.testing.assert_close(skip, dense, rtol=0, atol=0)
    for a, b in zip(_grads(skip, hidden, weight), _grads(dense, hidden, weight)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The head outside plain fp32 training (issue 11, items 6-8)


class _Allocations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not any(  # new buffers only, not views of an input (W.T)
                isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                for a in args
            ):
                self.outputs.append((func, tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_without_grad_the_head_computes_the_loss_only(mode):
    h, v, chunk = 16, 503, 8
    hidden, weight, labels = _inputs(b=2, s=40, h=h, v=v, seed=17)
    m = _valid(labels)
    ref = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk).detach()
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)
    if ctx is None:
        hidden, weight = hidden.detach(), weight.detach()
    with (ctx() if ctx else torch.enable_grad()), _HeadMatmuls(v) as seen, _Allocations() as made:
        got = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
    assert len(seen.calls) == -(-m // chunk)  # the logits GEMMs only
    assert not [o for o in made.outputs if sorted(o[1]) == sorted((v, h))], "a [V, H] buffer was made"
    assert not [o for o in made.outputs if o[1] == (2 * 40, h)], "a grad_h [N, H] buffer was made"
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_bf16_hidden_with_fp32_weight_under_autocast_behaves_as_f_linear():
    """Autocast casts both operands to bf16, as it does for HF's F.linear; grads keep each input's dtype."""
    hidden, weight, labels = _inputs(h=64, v=300, seed=18)
    hidden = hidden.detach().bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = ForCausalLMLoss(torch.nn.functional.linear(hidden, weight), labels, vocab_size=300)
        got = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=16)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # the same bf16 logits, fp32 loss both ways
    for a, b in zip(_grads(got, hidden, weight), _grads(ref, hidden, weight)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3)  # bf16 rounding of the GEMMs


def test_mixed_dtypes_outside_autocast_are_refused_like_f_linear():
    hidden, weight, labels = _inputs(seed=19)
    with pytest.raises(RuntimeError):
        torch.nn.functional.linear(hidden.bfloat16(), weight)
    with pytest.raises(RuntimeError, match="hidden states are torch.bfloat16 but the weight is torch.float32"):
        chunked_linear_cross_entropy(hidden.bfloat16(), weight, labels)


@pytest.mark.parametrize("frac", [0.0, 0.6])
def test_bias_loss_and_every_grad_equal_f_linear(frac):
    hidden, weight, labels = _inputs(seed=20, ignore_frac=frac)
    bias = (torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(21)) * 0.3).requires_grad_()
    ref = ForCausalLMLoss(torch.nn.functional.linear(hidden, weight, bias), labels, vocab_size=weight.shape[0])
    got = chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=16, bias=bias)
    torch.testing.assert_close(got, ref, **FP32)
    for a, b in zip(_grads(got, hidden, weight, bias), _grads(ref, hidden, weight, bias)):
        torch.testing.assert_close(a, b, **FP32)


def test_head_gradients_are_not_packed_by_saved_tensor_hooks():
    """Activation offload (save_on_cpu) packs what autograd saves; the head's fp32 grad W and
    grad h are results, not activations, and must stay where they are."""
    h, v = 16, 307
    hidden, weight, labels = _inputs(b=2, s=24, h=h, v=v, seed=22)
    packed = []

    def pack(t):
        packed.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_linear_cross_entropy(hidden * 1.0, weight, labels, chunk_size=8)
    loss.backward()
    assert not [p for p in packed if p[0] in ((v, h), (2 * 24, h))], packed


@pytest.mark.parametrize("skip_ignored", [True, False])
@pytest.mark.parametrize("pre_shifted", [False, True])
def test_out_of_range_label_says_which_target_as_hf_does(skip_ignored, pre_shifted):
    hidden, weight, labels = _inputs(v=64)
    labels[1, 5] = 99  # predicted at position (1, 4)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    with pytest.raises(IndexError, match=r"^Target 99 is out of bounds") as hf:
        ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=64)
    where = r"shift_labels\[1, 4\]" if pre_shifted else r"labels\[1, 5\]"
    kwargs = dict(shifted=shifted) if pre_shifted else {}
    with pytest.raises(IndexError, match=rf"^{hf.value.args[0].rstrip('.')}: {where} = 99 .*vocabulary has 64 tokens"):
        chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=4, skip_ignored=skip_ignored, **kwargs)
    labels[1, 5] = -3  # negative ids other than the ignore index are out of range too
    with pytest.raises(IndexError, match=r"^Target -3 is out of bounds"):
        chunked_linear_cross_entropy(hidden, weight, labels, skip_ignored=skip_ignored)
    labels[1, 5] = 63  # the last id is in range
    chunked_linear_cross_entropy(hidden, weight, labels, skip_ignored=skip_ignored)


# ---------------------------------------------------------------------------------------------
# Each family's own head: its final hidden states, its lm_head, the labels of a batch with images


@EVERY_FAMILY
def test_each_familys_head_equals_hf_and_trl_on_its_hidden_states(make_model, batch_factory):
    """The kernel on what it gets in training, per family: the backbone's final (normed) hidden
    states of a batch with image spans, and the family's lm_head at its own vocabulary and width.
    References: HF's ForCausalLMLoss (token_mean), :func:`full_cross_entropy` (sample_mean) and
    TRL's full-logits log-probs (per sequence), each with the gradients of hidden and weight."""
    model = make_model(chunk=False, seed=5)
    batch = batch_factory(images_per_sample=(1, 0, 2))
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    with torch.no_grad():
        model(**{k: v for k, v in batch.items() if k != "labels"})
    handle.remove()
    hidden = seen[0].requires_grad_()  # [B, S, H]
    weight = model.lm_head.weight.detach().clone().requires_grad_()  # [V, H]
    labels = batch["labels"]
    assert (labels != IGNORE_INDEX).any() and (labels == IGNORE_INDEX).any()  # image and pad positions ignored
    per_sequence = torch.tensor([0.5, -1.0, 2.0])  # DPO weighs each sequence's log-prob differently
    checks = [  # (reference on full logits [B, S, V], chunked)
        (ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0]),
         chunked_linear_cross_entropy(hidden, weight, labels, "token_mean", chunk_size=7)),
        (full_cross_entropy(hidden @ weight.T, labels, "sample_mean"),
         chunked_linear_cross_entropy(hidden, weight, labels, "sample_mean", chunk_size=13)),
        ((full_sequence_logps(hidden @ weight.T, labels)[0] * per_sequence).sum(),
         (sequence_logps(hidden, weight, labels, chunk_size=11)[0] * per_sequence).sum()),
    ]  # fmt: skip
    for ref, got in checks:
        torch.testing.assert_close(got, ref, **FP32)
        for a, b in zip(_grads(got, hidden, weight), _grads(ref, hidden, weight)):
            torch.testing.assert_close(a, b, **FP32)
