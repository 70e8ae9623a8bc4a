"""On-policy distillation's loss (:func:`qwenkit.model.losses.distill.reverse_kl_loss`) against its formulas.

Its form: each sampled token's reverse-KL sample ``k = log p_s(y) - log p_t(y)`` is a per-token advantage
``-k`` (no gradient) through the on-policy policy-gradient surrogate (Thinking Machines' on-policy
distillation, Tinker's ``importance_sampling`` loss), so its value is the token mean of ``k`` and its gradient
``k grad log p_s``. Two references: the formula written out on random sampled-token log-probs, and, its
expectation over the sampled token taken exactly (every token of the vocabulary, weighted by the student's
probability of it), TRL 1.16 GKD's full-vocabulary reverse KL (``generalized_jsd_loss(beta=1)``, the
``lmbda=1`` on-policy case) at several temperatures, dividing both models' logits as the sampler did.
"""

import pytest
import torch
from trl.experimental.gkd.gkd_trainer import GKDTrainer

from qwenkit.model.losses.distill import reverse_kl_loss

FP32 = dict(rtol=1e-6, atol=1e-7)  # the same float32 formula, summed in another order


def _sampled(b=4, t=9, seed=0):
    """The student's log-probs of sampled tokens (a leaf), the teacher's, a ragged completion mask."""
    g = torch.Generator().manual_seed(seed)
    student = (-torch.rand(b, t, generator=g) * 4).requires_grad_()
    teacher = -torch.rand(b, t, generator=g) * 4
    mask = torch.arange(t)[None, :] < torch.randint(1, t + 1, (b, 1), generator=g)
    return student, teacher, mask


@pytest.mark.parametrize("weighted", [False, True])
def test_value_and_gradient_are_the_sampled_reverse_kl_written_out(weighted):
    """Value ``sum_t w_t k_t / N``, gradient ``w_t k_t / N`` per token (``N``: the step's completion tokens,
    here more than this micro-batch's), ``k`` returned detached and 0 off the mask."""
    student, teacher, mask = _sampled()
    weights = torch.rand(student.shape, generator=torch.Generator().manual_seed(1)) + 0.5 if weighted else None
    tokens = int(mask.sum()) + 5  # the step's other micro-batches hold 5 more
    loss, k = reverse_kl_loss(student, teacher, mask, tokens, weights)
    w = weights if weighted else torch.ones_like(teacher)
    want_k = (student.detach() - teacher) * mask
    torch.testing.assert_close(k, want_k, **FP32)
    assert not k.requires_grad
    torch.testing.assert_close(loss, (w * want_k).sum() / tokens, **FP32)
    (grad,) = torch.autograd.grad(loss, student)
    torch.testing.assert_close(grad, w * want_k / tokens, **FP32)


def test_shares_of_micro_batches_sum_to_the_whole_step():
    student, teacher, mask = _sampled(b=6)
    whole, _ = reverse_kl_loss(student, teacher, mask, mask.sum())
    parts = sum(reverse_kl_loss(student[h], teacher[h], mask[h], mask.sum())[0] for h in (slice(0, 2), slice(2, 6)))
    torch.testing.assert_close(parts, whole, **FP32)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_expectation_over_the_sampled_token_is_trl_gkds_reverse_kl_and_its_gradient(temperature):
    """``E_{y ~ p_s}[loss]`` is GKD's ``KL(p_s || p_t)`` (``beta=1``) and ``E[grad]`` its gradient (the score
    function's: ``E[k grad log p_s] = grad KL`` since ``E[grad log p_s] = 0``), the expectation taken exactly:
    every vocabulary token as the sample, weighted by ``p_s`` (no gradient: the sampling distribution).
    Both models' log-probs are of their logits over ``temperature``, as the rollout sampled and as GKD divides."""
    g = torch.Generator().manual_seed(int(temperature * 10))
    b, t, v = 2, 5, 23
    student_logits = (torch.randn(b, t, v, generator=g) * 2).requires_grad_()
    teacher_logits = torch.randn(b, t, v, generator=g) * 2
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, 3:] = -100  # a completion shorter than the other
    mask = labels != -100
    want = GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels, beta=1.0, temperature=temperature)
    ls = torch.log_softmax(student_logits / temperature, -1)  # [b, t, v] every token's log-prob, as sampled
    lt = torch.log_softmax(teacher_logits / temperature, -1)
    every = mask[..., None].expand(b, t, v)
    # one "sample" per (position, token): rows b*t, columns v, each weighted by its probability under p_s
    got, _ = reverse_kl_loss(ls.reshape(b * t, v), lt.reshape(b * t, v), every.reshape(b * t, v), mask.sum(),
                             weights=ls.detach().exp().reshape(b * t, v))  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # a sum over v in another order
    (got_grad,) = torch.autograd.grad(got, student_logits)
    (want_grad,) = torch.autograd.grad(want, student_logits)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    assert want_grad.abs().max() > 1e-3  # not a trivial match: the student is far from the teacher
