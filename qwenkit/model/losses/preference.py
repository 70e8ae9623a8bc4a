"""Preference losses (DPO and its kin) of per-sequence log-probs: the math, no model.

Inputs are per pair ``p``: the policy's summed reply log-probs ``chosen[p]``, ``rejected[p]``
(:func:`qwenkit.model.losses.logps.sequence_logps`), the reference's ``ref_chosen[p]``,
``ref_rejected[p]`` (None for the reference-free SimPO), and the reply token counts. With the
log-ratios ``c = chosen - ref_chosen``, ``r = rejected - ref_rejected`` and ``beta``:

=========  =====================================================================  ==================
loss       per pair                                                               source
=========  =====================================================================  ==================
sigmoid    ``-(1-ε) logσ(β(c-r)) - ε logσ(-β(c-r))`` (ε = label_smoothing, cDPO)  DPO eq. 7; cDPO
ipo        ``(c/n_c - r/n_r - 1/(2β))²`` (log-ratios averaged per token, as TRL)  IPO eq. 17
hinge      ``relu(1 - β(c-r))``                                                   SLiC-HF
simpo      ``-(1-ε) logσ(β(ℓ_c-ℓ_r) - γ) - ε logσ(-(β(ℓ_c-ℓ_r) - γ))``,            SimPO eq. 6
           ``ℓ = logp / n`` (length-normalised, no reference)
=========  =====================================================================  ==================

Rewards (TRL's metrics): ``β c`` and ``β r``; SimPO's are ``β ℓ_c`` and ``β ℓ_r``.

The trainer's loss is the *share* of this rank's pairs in the global mean, as the SFT loss is a
share of the global token mean: ``sum(per pair) / global pairs`` plus, with ``dpo.sft_weight``
(RPO, LLaMA-Factory's ``pref_ftx``, TRL's ``loss_type=[..., "sft"]``), ``w * -sum(chosen) /
global chosen tokens``: world size and accumulation do not change it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qwenkit.config import DPO_LOSSES


@dataclass
class PreferenceTerms:
    losses: torch.Tensor  # [P] per pair
    chosen_rewards: torch.Tensor  # [P], detached
    rejected_rewards: torch.Tensor  # [P], detached


def pair_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    loss: str = "sigmoid",
    beta: float = 0.1,
    gamma: float = 0.0,
    label_smoothing: float = 0.0,
) -> PreferenceTerms:
    """Per-pair losses and rewards of ``loss`` (see the module docstring); all inputs ``[P]``."""
    if loss not in DPO_LOSSES:
        raise ValueError(f"dpo.loss must be one of {DPO_LOSSES}, got {loss!r}")
    n_c, n_r = chosen_tokens.clamp(min=1).float(), rejected_tokens.clamp(min=1).float()
    if loss == "simpo":
        c, r = chosen / n_c, rejected / n_r  # average log-prob per reply token
        logits = beta * (c - r) - gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
        return PreferenceTerms(losses, beta * c.detach(), beta * r.detach())
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"dpo.loss={loss!r} needs the reference's log-probs")
    c, r = chosen - ref_chosen, rejected - ref_rejected  # [P] log-ratios
    if loss == "sigmoid":
        logits = beta * (c - r)
        losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    elif loss == "hinge":
        losses = torch.relu(1 - beta * (c - r))
    else:  # ipo
        losses = (c / n_c - r / n_r - 1 / (2 * beta)) ** 2
    return PreferenceTerms(losses, beta * c.detach(), beta * r.detach())


def preference_loss_share(
    terms: PreferenceTerms,
    chosen: torch.Tensor,
    num_pairs: int | torch.Tensor,
    num_chosen_tokens: int | torch.Tensor,
    sft_weight: float = 0.0,
) -> torch.Tensor:
    """This rank's share of the global loss: ``sum(losses) / num_pairs (+ w * -sum(chosen) / tokens)``.

    ``num_pairs`` and ``num_chosen_tokens`` count the global batch (all ranks, all micro-batches).
    """
    share = terms.losses.sum() / torch.as_tensor(num_pairs, device=chosen.device).clamp(min=1)
    if sft_weight:
        share = share + sft_weight * -chosen.sum() / torch.as_tensor(num_chosen_tokens, device=chosen.device).clamp(min=1)
    return share


__all__ = ["DPO_LOSSES", "PreferenceTerms", "pair_losses", "preference_loss_share"]
