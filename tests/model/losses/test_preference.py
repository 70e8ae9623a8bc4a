"""Preference losses vs TRL's own: DPOTrainer's loss code (sigmoid, hinge, ipo, + sft) and CPOTrainer's
(label-smoothed sigmoid = cDPO, SimPO), called on the same log-probs.

TRL's losses live inside trainer methods; they are called here on stand-ins for the trainer and
the model that hand them exactly the per-sequence log-probs under test (TRL sums per-token
log-probs: here each reply token carries ``logp / n``). Then loss and TRL's metrics are compared.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.experimental.cpo.cpo_trainer import CPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer

from qwenkit.model.losses.preference import pair_losses, preference_loss_share

# fp32 on both sides; TRL sums n per-token shares of each log-prob (n <= 12): ~1e-6 relative
FP32 = dict(rtol=2e-5, atol=2e-6)
P, S = 5, 14


def _pairs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(4, P, generator=g) * 20  # policy chosen, rejected; reference chosen, rejected
    tokens = torch.randint(1, S - 2, (2, P), generator=g)  # reply tokens of chosen, rejected
    return (*logps, *tokens)


def _trl_dpo(chosen, rejected, ref_c, ref_r, n_c, n_r, loss_types, loss_weights, beta, label_smoothing=0.0):
    """TRL's DPOTrainer._compute_loss on log-probs; returns (loss, metrics)."""
    n = torch.cat([n_c, n_r])  # [2P]
    completion_mask = (torch.arange(S)[None, :] >= S - n[:, None]).long()  # the reply at the end; never position 0
    logps = torch.cat([chosen, rejected])
    per_token = completion_mask[:, 1:] * (logps / n)[:, None]  # [2P, S-1]; TRL sums it per sequence
    zeros = torch.zeros_like(per_token)
    outputs = SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    metrics = defaultdict(lambda: defaultdict(list))
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device="cpu", gather=lambda t: t, gather_for_metrics=lambda t: t),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=loss_types, loss_weights=loss_weights, beta=beta, label_smoothing=label_smoothing,
        use_weighting=False, _metrics=metrics, _total_train_tokens=0, _tp_size=1,
    )  # fmt: skip
    inputs = {
        "input_ids": torch.zeros(2 * P, S, dtype=torch.long), "attention_mask": torch.ones(2 * P, S, dtype=torch.long),
        "completion_mask": completion_mask, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r,
    }  # fmt: skip
    loss = DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, return_outputs=False)
    return loss, {k: v[0] for k, v in metrics["train"].items()}


def _ours(chosen, rejected, ref_c, ref_r, n_c, n_r, loss, beta, sft_weight=0.0, **kw):
    terms = pair_losses(chosen, rejected, ref_c, ref_r, n_c, n_r, loss, beta, **kw)
    return preference_loss_share(terms, chosen, P, n_c.sum(), sft_weight), terms


@pytest.mark.parametrize("loss", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("sft_weight", [0.0, 0.7])
def test_dpo_losses_equal_trl_dpo_trainer(loss, sft_weight):
    pairs = _pairs(seed=len(loss))
    beta = 0.1 if loss != "hinge" else 0.05  # hinge: keep some pairs inside the margin
    types, weights = [loss] + ["sft"] * bool(sft_weight), [1.0] + [sft_weight] * bool(sft_weight)
    ref, metrics = _trl_dpo(*pairs, types, weights, beta)
    got, terms = _ours(*pairs, loss, beta, sft_weight)
    torch.testing.assert_close(got, ref, **FP32)
    margins = terms.chosen_rewards - terms.rejected_rewards
    mine = {
        "rewards/chosen": terms.chosen_rewards.mean(), "rewards/rejected": terms.rejected_rewards.mean(),
        "rewards/margins": margins.mean(), "rewards/accuracies": (margins > 0).float().mean(),
        "logps/chosen": pairs[0].mean(), "logps/rejected": pairs[1].mean(),
    }  # fmt: skip
    for name, value in mine.items():
        assert value.item() == pytest.approx(metrics[name], rel=2e-5, abs=2e-6), name


def _trl_cpo(chosen, rejected, loss_type, beta, gamma=0.0, label_smoothing=0.0):
    trainer = SimpleNamespace(alpha=0.0, loss_type=loss_type, beta=beta, simpo_gamma=gamma,
                              label_smoothing=label_smoothing, accelerator=SimpleNamespace(device="cpu"))  # fmt: skip
    return CPOTrainer.cpo_loss(trainer, chosen, rejected)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_equals_trl_cpo_trainer_simpo(label_smoothing):
    chosen, rejected, _, _, n_c, n_r = _pairs(seed=3)
    # TRL's CPO averages the log-probs over the reply for SimPO (average_log_prob) before cpo_loss
    losses, rc, rr = _trl_cpo(chosen / n_c, rejected / n_r, "simpo", beta=2.0, gamma=0.5, label_smoothing=label_smoothing)
    terms = pair_losses(chosen, rejected, None, None, n_c, n_r, "simpo", beta=2.0, gamma=0.5,
                        label_smoothing=label_smoothing)  # fmt: skip
    for a, b in ((terms.losses, losses), (terms.chosen_rewards, rc), (terms.rejected_rewards, rr)):
        torch.testing.assert_close(a, b, **FP32)


def test_label_smoothed_sigmoid_equals_trl_conservative_dpo():
    """cDPO: TRL's DPOTrainer 1.16 dropped label_smoothing from sigmoid; its CPO keeps the formula
    (``-(1-ε) logσ(βz) - ε logσ(-βz)``), here applied to the log-ratio difference z."""
    chosen, rejected, ref_c, ref_r, n_c, n_r = _pairs(seed=4)
    losses, _, _ = _trl_cpo(chosen - ref_c, rejected - ref_r, "sigmoid", beta=0.3, label_smoothing=0.15)
    terms = pair_losses(chosen, rejected, ref_c, ref_r, n_c, n_r, "sigmoid", beta=0.3, label_smoothing=0.15)
    torch.testing.assert_close(terms.losses, losses, **FP32)


def test_shares_of_split_batches_add_up_to_the_whole():
    """Ranks and micro-batches each add their share of the global mean: the sum equals one batch's loss."""
    chosen, rejected, ref_c, ref_r, n_c, n_r = _pairs(seed=5)
    whole = preference_loss_share(pair_losses(chosen, rejected, ref_c, ref_r, n_c, n_r), chosen, P, n_c.sum(), 0.5)
    parts = sum(
        preference_loss_share(pair_losses(chosen[s], rejected[s], ref_c[s], ref_r[s], n_c[s], n_r[s]), chosen[s], P,
                              n_c.sum(), 0.5)  # fmt: skip
        for s in (slice(0, 2), slice(2, P))
    )
    torch.testing.assert_close(parts, whole, **FP32)


def test_reference_losses_need_the_reference():
    chosen, rejected, _, _, n_c, n_r = _pairs()
    with pytest.raises(ValueError, match="needs the reference"):
        pair_losses(chosen, rejected, None, None, n_c, n_r, "sigmoid")
