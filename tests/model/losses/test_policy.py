"""GRPO's loss and gradients vs TRL 1.16's own ``GRPOTrainer._compute_loss``; group advantages by hand.

TRL's loss lives inside a trainer method that first runs the model: it is called here on a
stand-in trainer whose ``_get_per_token_logps_and_entropies`` hands it exactly the log-probs under
test (a leaf tensor, so both sides' gradients with respect to the log-probs are compared). TRL's
advantages are computed inside ``_generate_and_score_completions`` with rollouts and reward
calls around them; its lines are reproduced verbatim in :func:`_trl_advantages`.
"""

import types
from collections import defaultdict

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

from qwenkit.config import GrpoConfig
from qwenkit.model.losses.policy import GrpoLoss, StepTotals, group_advantages, vllm_importance_weights

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


def _trl_loss(grpo: GrpoConfig, logps, old, ref, mask, advantages, accum=1, num_items=None):
    """TRL's GRPOTrainer._compute_loss on a stand-in trainer; returns (loss, TRL's metrics)."""
    metrics = {"train": defaultdict(list)}
    stand_in = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=grpo.importance_sampling_level, beta=grpo.beta, loss_type=grpo.loss_type,
        epsilon_low=grpo.epsilon, epsilon_high=grpo.epsilon if grpo.epsilon_high is None else grpo.epsilon_high,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accum),
        use_vllm=False, vllm_importance_sampling_correction=False, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accum, max_completion_length=grpo.max_new_tokens,
        accelerator=types.SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x),
        _entropy_bonus_enabled=False, _metrics=metrics,
    )  # fmt: skip
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
