"""Per-token log-probs and entropies (GRPO) and per-sequence sums (DPO) from the chunked head vs full-logits computations (TRL's).

The kernel against ``log_softmax`` of ``F.linear``'s logits over odd shapes, chunk sizes, a bias
and ignored rows; the model's ``token_logps`` against HF's own forward's logits on text, images
and video, every family; the backward never builds ``[B, S, V]``.
"""

import pytest
import torch
from conftest import EVERY_FAMILY
from torch.utils._python_dispatch import TorchDispatchMode

from model.families.test_chunked import _video_batch
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.losses.logps import full_sequence_logps, full_token_logps, sequence_logps, token_logps

# fp32 on both sides; the chunked head sums the softmax in another order: a few ulps of the sums
FP32 = dict(rtol=1e-5, atol=1e-6)


def _inputs(b=3, s=29, h=24, v=97, ignore_frac=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[torch.rand(b, s, generator=g) < ignore_frac] = IGNORE_INDEX
    return hidden, weight, labels


def _upstream(shape, seed=3):
    """A per-token upstream gradient, as GRPO's (each token weighted by its own ratio and advantage)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk", [1, 7, 16, 1000, "auto"])
@pytest.mark.parametrize("frac", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_token_logps_entropies_and_grads_equal_full_logits(chunk, frac, with_bias):
    hidden, weight, labels = _inputs(ignore_frac=frac, seed=7)
    bias = (torch.randn(97) * 0.1).requires_grad_() if with_bias else None
    ref, ref_ent = full_token_logps(torch.nn.functional.linear(hidden, weight, bias), labels)
    got, ent = token_logps(hidden, weight, labels, chunk_size=chunk, bias=bias, entropy=True)
    torch.testing.assert_close(got, ref, **FP32)
    torch.testing.assert_close(ent, ref_ent, **FP32)
    assert not ent.requires_grad
    g = _upstream(got.shape)
    tensors = (hidden, weight) + ((bias,) if with_bias else ())
    got_grads = torch.autograd.grad((got * g).sum(), tensors, allow_unused=True)
    for a, b in zip(got_grads, torch.autograd.grad((ref * g).sum(), tensors, allow_unused=True)):
        if frac == 1.0:  # no label: log-probs 0 and no gradient anywhere
            assert a is None or a.abs().max() == 0
            continue
        torch.testing.assert_close(a, b, **FP32)


@pytest.mark.parametrize("temperature", [0.3, 1.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tempered_logps_entropies_and_grads_equal_trls(temperature, with_bias):
    """GRPO's log-probs and entropy belong to the distribution the rollout sampled: TRL divides the
    logits by the temperature before both (``selective_log_softmax_and_entropy``, what its
    ``_get_per_token_logps_and_entropies`` computes)."""
    from trl.trainer.utils import selective_log_softmax_and_entropy

    hidden, weight, labels = _inputs(ignore_frac=0.3, seed=5)
    bias = (torch.randn(97) * 0.1).requires_grad_() if with_bias else None
    logits = torch.nn.functional.linear(hidden, weight, bias)[:, :-1]  # position t predicts labels[t + 1]
    target = labels[:, 1:]
    valid = target != IGNORE_INDEX
    ref, ref_ent = selective_log_softmax_and_entropy(logits, target.clamp(min=0), entropy_requires_grad=False,
                                                     temperature=temperature)  # fmt: skip
    got, ent = token_logps(hidden, weight, labels, chunk_size=7, bias=bias, entropy=True, temperature=temperature)
    torch.testing.assert_close(got[:, :-1], ref * valid, **FP32)
    torch.testing.assert_close(ent[:, :-1], ref_ent * valid, **FP32)
    g = _upstream(ref.shape)
    tensors = (hidden, weight) + ((bias,) if with_bias else ())
    want = torch.autograd.grad((ref * valid * g).sum(), tensors)
    for a, b in zip(torch.autograd.grad((got[:, :-1] * g).sum(), tensors), want):
        # summation-order noise is relative to the largest terms summed (1 / T scales them)
        torch.testing.assert_close(a, b, rtol=FP32["rtol"], atol=FP32["atol"] * max(1.0, float(b.abs().max())))
    untempered, _ = token_logps(hidden, weight, labels, chunk_size=7, bias=bias)
    assert not torch.allclose(got, untempered)  # the temperature is not a no-op here


@pytest.mark.parametrize("skip_ignored", [True, False])
def test_banned_tokens_logps_entropies_and_grads_equal_suppressed_full_logits(skip_ignored):
    """GRPO's rollouts never draw the media tokens (HF's ``SuppressTokensLogitsProcessor``, vLLM's logit
    bias): the log-probs, entropy and gradients are of the softmax over the other tokens. One banned token
    holds every row's largest logit (the max is taken after the ban) and gets no gradient."""
    from transformers import SuppressTokensLogitsProcessor

    hidden, weight, labels = _inputs(ignore_frac=0.3, seed=11)
    banned = [0, 40, 96]
    labels[torch.isin(labels, torch.tensor(banned))] = 1  # a completion holds no banned token
    bias = torch.zeros(97)
    bias[40] = 50.0  # above every other logit
    bias.requires_grad_()
    logits = torch.nn.functional.linear(hidden, weight, bias)
    suppress = SuppressTokensLogitsProcessor(banned)
    suppressed = torch.stack([suppress(None, row) for row in logits.unbind(0)])
    ref, ref_ent = full_token_logps(logits, labels, temperature=0.6, banned=banned)
    torch.testing.assert_close(ref, full_token_logps(suppressed, labels, temperature=0.6)[0], **FP32)
    got, ent = token_logps(hidden, weight, labels, chunk_size=7, bias=bias, entropy=True, temperature=0.6,
                           banned=banned, skip_ignored=skip_ignored)  # fmt: skip
    torch.testing.assert_close(got, ref, **FP32)
    torch.testing.assert_close(ent, ref_ent, **FP32)
    assert ent.isfinite().all()
    g = _upstream(got.shape)
    tensors = (hidden, weight, bias)
    for a, b in zip(torch.autograd.grad((got * g).sum(), tensors), torch.autograd.grad((ref * g).sum(), tensors)):
        torch.testing.assert_close(a, b, **FP32)
    grad_w = torch.autograd.grad((token_logps(hidden, weight, labels, banned=banned)[0] * g).sum(), weight)[0]
    assert (grad_w[banned] == 0).all() and (grad_w.abs().sum(1) > 0).sum() == 97 - len(banned)
    unbanned, _ = token_logps(hidden, weight, labels, chunk_size=7, bias=bias, temperature=0.6)
    assert (unbanned[got != 0] < -10).all()  # unbanned, token 40 holds nearly all the mass


def test_skip_ignored_and_dense_agree_and_without_entropy_none_is_returned():
    hidden, weight, labels = _inputs(b=2, s=33, h=16, v=64, ignore_frac=0.5, seed=2)
    dense, ent = token_logps(hidden, weight, labels, chunk_size=8, skip_ignored=False)
    sparse, _ = token_logps(hidden, weight, labels, chunk_size=8)
    assert ent is None
    torch.testing.assert_close(sparse, dense, **FP32)  # other GEMM shapes: a few ulps
    shifted_ignored = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:] == IGNORE_INDEX
    assert (sparse[shifted_ignored] == 0).all() and (sparse[~shifted_ignored] < 0).all()


def test_token_logps_build_no_full_logits():
    hidden, weight, labels = _inputs(b=2, s=64, h=16, v=512, ignore_frac=0.0)
    sizes = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                sizes.append(out.numel())
            return out

    with Watch():
        got, _ = token_logps(hidden, weight, labels, chunk_size=16, entropy=True)
        (got * _upstream(got.shape)).sum().backward()
    assert max(sizes) < 2 * 64 * 512  # never [B, S, V]: at most a [16, V] chunk or grad W [V, H]


def test_out_of_range_labels_name_their_position():
    hidden, weight, labels = _inputs(v=50)
    labels[1, 5] = 99
    with pytest.raises(IndexError, match=r"labels\[1, 5\] = 99 .*vocabulary has 50 tokens"):
        token_logps(hidden, weight, labels)


# ---------------------------------------------------------------------------------------------
# Per-sequence log-probs (preference objectives) vs TRL's full-logits log_softmax gather


def _trl_logps(hidden, weight, labels, bias=None):
    """TRL's computation: full logits, log_softmax, gather the shifted labels, sum per sequence."""
    logits = torch.nn.functional.linear(hidden, weight, bias)  # [B, S, V]
    return full_sequence_logps(logits, labels)


@pytest.mark.parametrize("chunk", [1, 7, 16, 1000, "auto"])
@pytest.mark.parametrize("frac", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_sequence_logps_and_their_grads_equal_full_logits(chunk, frac, with_bias):
    hidden, weight, labels = _inputs(b=4, s=29, h=24, v=97, ignore_frac=frac, seed=7)
    bias = (torch.randn(97) * 0.1).requires_grad_() if with_bias else None
    ref, ref_n = _trl_logps(hidden, weight, labels, bias)
    got, n = sequence_logps(hidden, weight, labels, chunk_size=chunk, bias=bias)
    torch.testing.assert_close(got, ref, **FP32)
    assert n.tolist() == ref_n.tolist()
    # a per-sequence upstream gradient, as DPO's is (each sequence weighted differently)
    g = torch.tensor([0.3, -1.7, 2.0, 0.0])
    tensors = (hidden, weight) + ((bias,) if with_bias else ())
    for a, b in zip(torch.autograd.grad((got * g).sum(), tensors), torch.autograd.grad((ref * g).sum(), tensors)):
        torch.testing.assert_close(a, b, **FP32)


def test_sequence_logps_skip_ignored_and_dense_agree_and_ignored_rows_get_no_gradient():
    hidden, weight, labels = _inputs(b=2, s=33, h=16, v=64, ignore_frac=0.5, seed=2)
    labels[1] = IGNORE_INDEX  # a sequence without labels: logp 0, count 0, no gradient
    dense, _ = sequence_logps(hidden, weight, labels, chunk_size=8, skip_ignored=False)
    sparse, n = sequence_logps(hidden, weight, labels, chunk_size=8)
    torch.testing.assert_close(sparse, dense, **FP32)
    assert sparse[1] == 0 and n[1] == 0
    (gh,) = torch.autograd.grad(sparse.sum(), hidden)
    assert gh[1].abs().max() == 0


def test_sequence_logps_build_no_full_logits():
    hidden, weight, labels = _inputs(b=2, s=64, h=16, v=512, ignore_frac=0.0)
    sizes = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                sizes.append(out.numel())
            return out

    with Watch():
        got, _ = sequence_logps(hidden, weight, labels, chunk_size=16)
        got.sum().backward()
    assert max(sizes) < 2 * 64 * 512  # never [B, S, V]: at most one [16, V] chunk or grad W [V, H]


@EVERY_FAMILY
@pytest.mark.parametrize("media", ["text", "images", "video"])
def test_model_token_logps_equal_hf_full_logits_and_their_grads(make_model, batch_factory, family_processor, family, media):
    model = make_model(chunk=True, seed=1)
    model.configure_loss(chunk=True, chunk_size=9)
    if media == "video":
        batch = _video_batch(family_processor, family)
    else:
        batch = batch_factory(images_per_sample=(0, 0) if media == "text" else (1, 0, 2))
    got, ent = model.token_logps(**batch, entropy=True)
    model.chunk_loss = False  # HF's own forward: full [B, S, V] logits
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    ref, ref_ent = full_token_logps(logits, batch["labels"])
    torch.testing.assert_close(got, ref, **FP32)
    torch.testing.assert_close(ent, ref_ent, **FP32)
    assert (got != 0).sum() > 0
    g = _upstream(got.shape)
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad((ref * g).sum(), params, allow_unused=True)
    model.chunk_loss = True
    got_grads = torch.autograd.grad((model.token_logps(**batch)[0] * g).sum(), params, allow_unused=True)
    for a, b in zip(got_grads, want):
        if a is not None or b is not None:
            # fp32 summation-order noise is relative to the largest terms summed: a weight gradient of
            # magnitude 10 (Qwen3.5's linear-attention projections) differs by a few 1e-6 in its last bits
            torch.testing.assert_close(a, b, rtol=FP32["rtol"], atol=FP32["atol"] * max(1.0, float(b.abs().max())))
