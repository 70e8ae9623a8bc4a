"""GRPO's loss and gradients vs TRL 1.16's own ``GRPOTrainer._compute_loss``; group advantages by hand.

TRL's loss lives inside a trainer method that first runs the model: it is called here on a
stand-in trainer whose ``_get_per_token_logps_and_entropies`` hands it exactly the log-probs under
test (a leaf tensor, or the tempered log-softmax of leaf logits, so both sides' gradients with
respect to them are compared) and their entropies (``top_entropy_quantile``: TRL's own
``get_high_entropy_mask`` on the stand-in). TRL's advantages are computed inside
``_generate_and_score_completions`` with rollouts and reward calls around them; its lines are
reproduced verbatim in :func:`_trl_advantages`. GMPO, which TRL 1.16 has not, is compared with the
paper's formula written out (:func:`_gmpo_by_the_paper`).
"""

import math
import types
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
from multiproc import check_ranks
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

from qwenkit.config import GrpoConfig
from qwenkit.model.losses.policy import (
    GrpoLoss,
    StepTotals,
    group_advantages,
    high_entropy_mask,
    vllm_importance_weights,
)  # fmt: skip

FP32 = dict(rtol=1e-6, atol=1e-7)  # same float32 formulas, summed in the same order but for the normaliser
MAX_NEW = 12


def _rollout(b=6, t=MAX_NEW, seed=0, drift=0.3):
    """Log-probs of a policy a few updates past its rollout policy, the reference's, a ragged mask."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    logps = (old + drift * torch.randn(b, t, generator=g)).requires_grad_()
    ref = old + 0.2 * torch.randn(b, t, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t  # one completion cut at max_new_tokens
    mask = (torch.arange(t)[None] < lengths[:, None]).int()
    advantages = torch.randn(b, generator=g)
    return logps, old, ref, mask, advantages


def _trl_loss(grpo: GrpoConfig, logps, old, ref, mask, advantages, accum=1, num_items=None, entropies=None):
    """TRL's GRPOTrainer._compute_loss on a stand-in trainer; returns (loss, TRL's metrics)."""
    metrics = {"train": defaultdict(list)}
    entropies = torch.zeros_like(logps) if entropies is None else entropies
    stand_in = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropies, None),
        aux_loss_enabled=False, top_entropy_quantile=grpo.top_entropy_quantile, off_policy_mask_threshold=None,
        importance_sampling_level=grpo.importance_sampling_level, beta=grpo.beta, loss_type=grpo.loss_type,
        epsilon_low=grpo.epsilon, epsilon_high=grpo.epsilon if grpo.epsilon_high is None else grpo.epsilon_high,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accum,
                                   sapo_temperature_pos=grpo.sapo_temperature_pos,
                                   sapo_temperature_neg=grpo.sapo_temperature_neg),
        use_vllm=False, vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accum, max_completion_length=grpo.max_new_tokens,
        accelerator=types.SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x,
                                          pad_across_processes=lambda x, dim, pad_index: x),
        _entropy_bonus_enabled=False, _metrics=metrics,
    )  # fmt: skip
    stand_in.get_high_entropy_mask = types.MethodType(GRPOTrainer.get_high_entropy_mask, stand_in)
    inputs = {
        "prompt_ids": torch.zeros(len(mask), 1, dtype=torch.long), "prompt_mask": torch.ones(len(mask), 1, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask), "completion_mask": mask, "advantages": advantages,
        "old_per_token_logps": old, "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(mask.sum() if num_items is None else num_items)),
    }  # fmt: skip
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    return loss, {k: v[-1] for k, v in metrics["train"].items()}


LOSSES = ["grpo", "dr_grpo", "dapo", "bnpo"]


@pytest.mark.parametrize("loss_type", LOSSES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta, epsilon_high", [(0.0, None), (0.04, 0.28)])
def test_loss_gradients_and_clip_metrics_equal_trl(loss_type, level, beta, epsilon_high):
    grpo = GrpoConfig(loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_high=epsilon_high,
                      max_new_tokens=MAX_NEW)  # fmt: skip
    logps, old, ref, mask, adv = _rollout(seed=3)
    want, metrics = _trl_loss(grpo, logps, old, ref, mask, adv)
    (want_grad,) = torch.autograd.grad(want, logps)
    totals = StepTotals(completions=len(mask), tokens=int(mask.sum()), micro_batches=1)
    terms = GrpoLoss(grpo)(logps, adv, mask, totals, old=old, ref=ref if beta else None)
    torch.testing.assert_close(terms.loss, want, **FP32)
    (got_grad,) = torch.autograd.grad(terms.loss, logps)
    torch.testing.assert_close(got_grad, want_grad, **FP32)
    m = mask.float() if level == "token" else torch.ones(len(mask), 1)
    low, high = terms.low_clipped.float(), terms.high_clipped.float()
    assert metrics["clip_ratio/low_mean"] == pytest.approx(float((low * m).sum() / m.sum()), rel=1e-6)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(float((high * m).sum() / m.sum()), rel=1e-6)
    assert metrics["clip_ratio/low_mean"] + metrics["clip_ratio/high_mean"] > 0  # the drift clips some tokens
    if beta:
        kl = float((terms.kl * mask).sum() / mask.sum())
        assert metrics["kl"] == pytest.approx(kl, rel=1e-6)


@pytest.mark.parametrize("loss_type", LOSSES)
def test_shares_of_two_micro_batches_sum_to_trl_accumulated(loss_type):
    """Accumulation: TRL's two micro-batches (each divided by the accumulation steps, dapo by the
    step's tokens) sum to what qwenkit's shares of the same step sum to."""
    grpo = GrpoConfig(loss_type=loss_type, beta=0.04, max_new_tokens=MAX_NEW)
    logps, old, ref, mask, adv = _rollout(b=8, seed=5)
    halves = [slice(0, 4), slice(4, 8)]  # TRL's micro-batches are equal; their token counts are not (bnpo != dapo)
    want = sum(_trl_loss(grpo, logps[h], old[h], ref[h], mask[h], adv[h], accum=2, num_items=mask.sum())[0]
               for h in halves)  # fmt: skip
    totals = StepTotals(completions=8, tokens=int(mask.sum()), micro_batches=2)
    loss = GrpoLoss(grpo)
    got = sum(loss(logps[h], adv[h], mask[h], totals, old=old[h], ref=ref[h]).loss for h in halves)
    torch.testing.assert_close(got, want, **FP32)


def test_step_one_is_on_policy_and_reference_gives_kl_zero_and_the_advantage_as_gradient():
    """At the rollout's own policy (old = logp.detach(), ref = logp) the ratio is 1, nothing is clipped,
    KL is 0 and the dapo loss is -mean(A) with gradient -A/tokens on each token."""
    logps, _, _, mask, adv = _rollout(seed=1)
    terms = GrpoLoss(GrpoConfig(beta=0.1))(logps, adv, mask, StepTotals(6, int(mask.sum()), 1), ref=logps.detach())
    assert (terms.kl == 0).all() and (terms.ratio == 1).all() and not terms.low_clipped.any()
    torch.testing.assert_close(terms.loss, -(adv[:, None] * mask).sum() / mask.sum(), **FP32)
    (grad,) = torch.autograd.grad(terms.loss, logps)
    torch.testing.assert_close(grad, -adv[:, None] * mask / mask.sum(), **FP32)


def test_truncated_completions_are_masked_when_asked():
    logps, old, _, mask, adv = _rollout(seed=2)
    truncated = torch.zeros(6, dtype=torch.bool)
    truncated[0] = True
    kept = mask.clone()
    kept[0] = 0
    totals = StepTotals(6, int(kept.sum()), 1)
    on = GrpoLoss(GrpoConfig(mask_truncated_completions=True))(logps, adv, mask, totals, old=old, truncated=truncated)
    off = GrpoLoss(GrpoConfig())(logps, adv, kept, totals, old=old)
    torch.testing.assert_close(on.loss, off.loss, rtol=0, atol=0)
    assert (on.mask[0] == 0).all()


def _trl_advantages(rewards, num_generations, scale_rewards):
    """TRL 1.16 ``_generate_and_score_completions``, sum_then_normalize, verbatim (one reward function)."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:  # batch
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return advantages, torch.isclose(std_rewards, torch.zeros_like(std_rewards))


def test_group_advantages_by_hand_and_as_trl():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])  # two groups of 4; the second all alike
    adv, zero = group_advantages(rewards, 4, "group")
    std = (1 / 3) ** 0.5  # unbiased std of [1, 0, 0, 1]: sqrt(4 * 0.25 / 3)
    want = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4)
    torch.testing.assert_close(adv, torch.cat([want, torch.zeros(4)]))
    assert zero.tolist() == [False] * 4 + [True] * 4
    adv, _ = group_advantages(rewards, 4, "none")  # Dr. GRPO: centred, not scaled
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    g = torch.Generator().manual_seed(0)
    for scale in ("group", "batch", "none"):
        r = torch.rand(12, generator=g)
        (adv, zero), (want, want_zero) = group_advantages(r, 3, scale), _trl_advantages(r, 3, scale)
        torch.testing.assert_close(adv, want, **FP32)  # torch.std vs TRL's nanstd: an ulp apart
        assert zero.tolist() == want_zero.tolist()
    with pytest.raises(ValueError, match=r"7 rewards do not form groups of grpo.num_generations=4"):
        group_advantages(torch.zeros(7), 4, "group")


def test_truncated_and_masked_importance_weights_follow_trls_formulas():
    old = torch.tensor([[-1.0, -2.0, -3.0, 0.0]])
    sampling = torch.tensor([[-1.5, -0.5, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    ratio = torch.exp((old - sampling) * mask)  # TRL: exp(old - sampling) on the completion tokens
    got = vllm_importance_weights(old, sampling, mask, "token_truncate", None, 1.5)
    torch.testing.assert_close(got, ratio.clamp(max=1.5))
    got = vllm_importance_weights(old, sampling, mask, "token_mask", 0.5, 1.5)
    torch.testing.assert_close(got, torch.where((ratio < 0.5) | (ratio > 1.5), 0.0, ratio))
    seq = torch.exp(((old - sampling) * mask).sum(-1, keepdim=True))
    torch.testing.assert_close(vllm_importance_weights(old, sampling, mask, "sequence_truncate", None, 3.0), seq.clamp(max=3.0))
    torch.testing.assert_close(vllm_importance_weights(old, sampling, mask, "sequence_mask", 0.5, None), torch.zeros(1, 1))


def test_the_importance_weights_scale_each_tokens_loss_before_the_kl():
    """TRL: ``per_token_loss * importance_sampling_ratio``, then ``+ beta * kl``."""
    torch.manual_seed(0)
    logps, ref = torch.randn(2, 3) - 2, torch.randn(2, 3) - 2
    adv, mask = torch.tensor([1.0, -0.5]), torch.ones(2, 3)
    weights = torch.rand(2, 3) + 0.5
    loss = GrpoLoss(GrpoConfig(loss_type="dapo", beta=0.1))
    totals = StepTotals(completions=2, tokens=6, micro_batches=1)
    plain = loss(logps, adv, mask, totals, ref=ref)
    weighted = loss(logps, adv, mask, totals, ref=ref, is_ratio=weights)
    policy = -adv[:, None] * torch.ones(2, 3)  # ratio 1 (old = logps): -A per token
    torch.testing.assert_close(weighted.loss, ((policy * weights + 0.1 * plain.kl) * mask).sum() / 6)
    torch.testing.assert_close(plain.loss, ((policy + 0.1 * plain.kl) * mask).sum() / 6)


# --- CISPO, SAPO, GMPO and the high-entropy tokens: through tempered logits --------------------------------------

TEMPERATURES = [0.7, 1.0, 1.6]  # the sampling temperature the log-probs and entropies are of


def _tempered(temperature, b=6, t=MAX_NEW, v=13, seed=0, drift=0.3):
    """``(logits, logps, entropies, old, ref, mask, advantages)``: leaf logits ``[B, T, V]``, the log-probs of
    sampled tokens and the entropies under ``softmax(z / T)`` (what the chunked head hands the loss), the
    rollout policy's and the reference's log-probs a drift away, a ragged mask (one completion full)."""
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(b, t, v, generator=g)).requires_grad_()
    logprobs = torch.log_softmax(logits / temperature, -1)  # [B, T, V]
    logps = logprobs.gather(-1, torch.randint(v, (b, t, 1), generator=g)).squeeze(-1)  # [B, T]
    entropies = -(logprobs.exp() * logprobs).sum(-1).detach()
    old = logps.detach() + drift * torch.randn(b, t, generator=g)
    ref = logps.detach() + 0.2 * torch.randn(b, t, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None] < lengths[:, None]).int()
    return logits, logps, entropies, old, ref, mask, torch.randn(b, generator=g)


def _grad(loss, logits):
    return torch.autograd.grad(loss, logits, retain_graph=True)[0]


def _against_trl(grpo, temperature, seed, drift=0.3, truncated=None):
    """The kit's loss and TRL's on the same tempered inputs: ``(got, want, TRL's metrics, terms)``, gradients by logits."""
    logits, logps, entropies, old, ref, mask, adv = _tempered(temperature, seed=seed, drift=drift)
    trl_mask = mask if truncated is None else mask * (~truncated).int()[:, None]  # TRL's completion_mask
    want, metrics = _trl_loss(grpo, logps, old, ref, trl_mask, adv, entropies=entropies)
    totals = StepTotals(completions=len(mask), tokens=int(trl_mask.sum()), micro_batches=1)
    terms = GrpoLoss(grpo)(logps, adv, mask, totals, old=old, ref=ref if grpo.beta else None, truncated=truncated,
                           entropies=entropies)  # fmt: skip
    torch.testing.assert_close(terms.loss, want, **FP32)
    torch.testing.assert_close(_grad(terms.loss, logits), _grad(want, logits), **FP32)
    return terms, metrics


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta, epsilon_high", [(0.0, 5.0), (0.04, 1.2)])
def test_cispo_loss_gradients_and_clip_share_equal_trl(temperature, level, beta, epsilon_high):
    """CISPO: ``-sg(min(r, epsilon_high)) A logp`` over the step's tokens; every token keeps a gradient,
    the clipped ones too (PPO's clip would zero theirs). ``clip_ratio/high_mean`` is TRL's ``cispo_clip_ratio``."""
    grpo = GrpoConfig(loss_type="cispo", importance_sampling_level=level, beta=beta, epsilon_high=epsilon_high,
                      max_new_tokens=MAX_NEW)  # fmt: skip
    terms, metrics = _against_trl(grpo, temperature, seed=4, drift=0.5)
    m = terms.mask if level == "token" else torch.ones(len(terms.mask), 1)
    assert metrics["cispo_clip_ratio"] == pytest.approx(float((terms.high_clipped * m).sum() / m.sum()), rel=1e-6)
    assert not terms.low_clipped.any()
    if level == "token" and epsilon_high < 2:
        assert terms.high_clipped.any()  # the drift pushes some ratios over 1.2


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """A token whose weight is clipped still gets ``-w A / tokens`` (the clipped weight), where PPO's gets 0."""
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -4.0]])  # ratios 1 and e^2 > 5
    grpo = GrpoConfig(loss_type="cispo", epsilon_high=5.0)
    loss = GrpoLoss(grpo)(logps, torch.tensor([1.0]), torch.ones(1, 2), StepTotals(1, 2, 1), old=old).loss
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(grad, torch.tensor([[-1.0 / 2, -5.0 / 2]]))
    ppo = GrpoLoss(GrpoConfig(loss_type="dapo"))(logps, torch.tensor([1.0]), torch.ones(1, 2), StepTotals(1, 2, 1), old=old)
    assert torch.autograd.grad(ppo.loss, logps)[0][0, 1] == 0


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("tau_pos, tau_neg", [(1.0, 1.05), (0.5, 2.0), (4.0, 0.25)])
@pytest.mark.parametrize("level, beta", [("token", 0.0), ("token", 0.04), ("sequence", 0.0)])
def test_sapo_loss_and_gradients_equal_trl_at_several_gate_temperatures(temperature, tau_pos, tau_neg, level, beta):
    """SAPO: ``-sigmoid(tau (r - 1)) 4 / tau A``, tau by the advantage's sign, each completion's token mean (TRL's grpo
    normalisation); nothing is hard-clipped."""
    grpo = GrpoConfig(loss_type="sapo", sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg,
                      importance_sampling_level=level, beta=beta, max_new_tokens=MAX_NEW)  # fmt: skip
    terms, _ = _against_trl(grpo, temperature, seed=6, drift=0.6)
    assert not terms.low_clipped.any() and not terms.high_clipped.any()


def _gmpo_by_the_paper(logps, old, mask, adv, eps_low, eps_high):
    """GMPO's objective as arXiv 2507.20673 writes it, in float64, token by token:
    ``J = 1/G sum_i (prod_t |min(r_t A_i, clip(r_t, e^-eps_low, e^eps_high) A_i)|)^(1/|o_i|) sgn(A_i)``; the loss is ``-J``."""
    total = 0.0
    for i in range(len(adv)):
        a = adv[i].double()
        product = torch.ones((), dtype=torch.float64)
        tokens = [t for t in range(mask.shape[1]) if mask[i, t]]
        for t in tokens:
            r = torch.exp(logps[i, t].double() - old[i, t].double())
            clipped = torch.clamp(r, math.exp(-eps_low), math.exp(eps_high))
            product = product * torch.abs(torch.min(r * a, clipped * a))
        total = total + product ** (1 / len(tokens)) * torch.sign(a)
    return -total / len(adv)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("epsilon, epsilon_high", [(0.4, None), (0.2, 0.3), (0.05, 0.1)])
def test_gmpo_loss_and_gradients_equal_the_papers_formula(temperature, epsilon, epsilon_high):
    """The kit computes it in log space (the mean of the pessimistically clipped log-ratios); the paper's
    product of token ratios, in float64, gives the same loss and gradients to float32's rounding."""
    grpo = GrpoConfig(loss_type="gmpo", epsilon=epsilon, epsilon_high=epsilon_high, max_new_tokens=MAX_NEW)
    logits, logps, _, old, _, mask, adv = _tempered(temperature, seed=8, drift=0.4)
    want = _gmpo_by_the_paper(logps, old, mask, adv, epsilon, epsilon if epsilon_high is None else epsilon_high)
    terms = GrpoLoss(grpo)(logps, adv, mask, StepTotals(len(mask), int(mask.sum()), 1), old=old)
    torch.testing.assert_close(terms.loss.double(), want, rtol=1e-5, atol=1e-7)  # fp32 log space vs fp64 products
    torch.testing.assert_close(_grad(terms.loss, logits).double(), _grad(want, logits).double(), rtol=1e-4, atol=1e-7)
    high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = logps.detach() - old
    assert torch.equal(terms.high_clipped, (log_ratio > high) & (adv[:, None] > 0))
    assert torch.equal(terms.low_clipped, (log_ratio < -epsilon) & (adv[:, None] < 0))
    assert (terms.high_clipped | terms.low_clipped)[mask.bool()].any()  # the drift clips some tokens


def test_gmpo_is_one_ratio_per_completion_and_on_policy_minus_the_mean_advantage():
    """At the rollout's own policy each completion's geometric mean is 1: the loss is ``-mean(A)`` over
    completions, each token's gradient ``-A / (|o| G)`` (the ratio's own gradient, 1)."""
    logps, _, _, mask, adv = _rollout(seed=9)
    terms = GrpoLoss(GrpoConfig(loss_type="gmpo"))(logps, adv, mask, StepTotals(6, int(mask.sum()), 1))
    torch.testing.assert_close(terms.loss, -adv.mean(), **FP32)
    (grad,) = torch.autograd.grad(terms.loss, logps)
    torch.testing.assert_close(grad, -adv[:, None] * mask / mask.sum(-1, keepdim=True) / 6, **FP32)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("quantile", [0.0, 0.2, 0.5, 0.8])
@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("grpo", "sequence"), ("cispo", "token"), ("sapo", "token")])
def test_top_entropy_quantile_equals_trls_high_entropy_mask(temperature, quantile, loss_type, level):
    """Only the tokens at or above the micro-batch's ``1 - quantile`` entropy quantile carry the policy
    loss (TRL's ``get_high_entropy_mask`` on its stand-in), the KL every token; truncated completions
    masked out are not counted in the quantile."""
    grpo = GrpoConfig(loss_type=loss_type, importance_sampling_level=level, top_entropy_quantile=quantile, beta=0.04,
                      epsilon_high=5.0 if loss_type == "cispo" else None, mask_truncated_completions=True,
                      max_new_tokens=MAX_NEW)  # fmt: skip
    truncated = torch.tensor([True, False, False, False, False, False])
    _against_trl(grpo, temperature, seed=10, truncated=truncated)


def test_high_entropy_mask_keeps_the_top_fraction_of_the_completion_tokens():
    entropies = torch.tensor([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # the 7.0 is padding: neither counted nor kept
    kept = high_entropy_mask(entropies, mask, 0.25)  # the top quarter of 7 tokens: at or above their 75% quantile
    assert kept.tolist() == [[False, True, False, False], [False, True, False, False]]
    assert high_entropy_mask(entropies, mask, 1.0).equal(mask.bool())
    assert high_entropy_mask(entropies, torch.zeros_like(mask), 0.2).sum() == 0


def test_high_entropy_mask_past_torch_quantiles_limit():
    """torch.quantile refuses more than 2**24 values (a micro-batch's tokens on every rank reach it at
    length); the kit's threshold is the same linear interpolation without the limit."""
    n = 2**24 + 1
    entropies = torch.randperm(n, generator=torch.Generator().manual_seed(0)).float()[None]  # 0..2**24, exact in fp32
    with pytest.raises(RuntimeError, match="quantile"):
        torch.quantile(entropies[0], 0.5)
    assert int(high_entropy_mask(entropies, torch.ones_like(entropies), 0.5).sum()) == n - 2**23  # >= the median 2**23


def _ranks_entropy_mask(rank, out):
    """Rank ``r`` holds its share of one micro-batch (shares of unequal token counts)."""
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    entropies, mask = torch.rand(2, 4, 9, generator=g), (torch.rand(2, 4, 9, generator=g) > 0.3).int()
    mask[1, :, 6:] = 0  # rank 1 has fewer tokens
    torch.save(high_entropy_mask(entropies[rank], mask[rank], 0.2), out / f"mask-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_entropy_threshold_is_over_the_micro_batch_on_every_rank(tmp_path):
    """As TRL (``pad_across_processes`` + ``gather``): each rank's mask is the one-process mask of every rank's share."""
    check_ranks(_ranks_entropy_mask, 2, tmp_path)
    g = torch.Generator().manual_seed(0)
    entropies, mask = torch.rand(2, 4, 9, generator=g), (torch.rand(2, 4, 9, generator=g) > 0.3).int()
    mask[1, :, 6:] = 0
    whole = high_entropy_mask(entropies.reshape(8, 9), mask.reshape(8, 9), 0.2)
    got = torch.cat([torch.load(tmp_path / f"mask-{r}.pt") for r in (0, 1)])
    assert torch.equal(got, whole)
    assert not torch.equal(got[:4], high_entropy_mask(entropies[0], mask[0], 0.2))  # rank 0's own threshold differs


def _sp_group_entropy_mask(rank, out):
    """Both ranks are one sequence-parallel group: each holds the whole micro-batch (its entropies gathered from
    the slices); the threshold counts the first rank's tokens only, then (as a check) every rank's."""
    dist.init_process_group("gloo")
    entropies, mask = torch.tensor([[0.0, 1.0, 2.0]]), torch.ones(1, 3, dtype=torch.int)
    once = high_entropy_mask(entropies, mask, 0.8, counted=rank == 0)
    twice = high_entropy_mask(entropies, mask, 0.8)
    torch.save({"once": once, "twice": twice}, out / f"sp-mask-{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_entropy_threshold_of_a_sequence_parallel_group_counts_each_token_once(tmp_path):
    """Under ``parallel.sp_size`` the group's ranks hold the same tokens: the one-process mask on each, where every
    rank counting its copy would move the threshold (the 20% quantile of [0, 1, 2] is 0.4, of [0, 0, 1, 1, 2, 2] 0)."""
    check_ranks(_sp_group_entropy_mask, 2, tmp_path)
    want = high_entropy_mask(torch.tensor([[0.0, 1.0, 2.0]]), torch.ones(1, 3, dtype=torch.int), 0.8)
    assert want.tolist() == [[False, True, True]]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"sp-mask-{rank}.pt")
        assert torch.equal(got["once"], want)
        assert got["twice"].tolist() == [[True, True, True]]  # the threshold over the repeated tokens
