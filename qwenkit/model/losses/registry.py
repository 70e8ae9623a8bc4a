"""The policy losses by name (``grpo.loss_type``): one entry each, the one list the config and the trainer read.

An entry names its per-token surrogate by import path (the light table stays the standard library's, so
the config's leaf reads the names without importing torch, as it reads the families) and the reduction
that turns per-token losses into the step's loss. verl registers a policy loss with
``@register_policy_loss(name)``; here the entry is the registration and :func:`policy_loss` the lookup,
so :class:`qwenkit.model.losses.policy.GrpoLoss` has no ``if`` over names: a new loss is one entry here
and its function in :mod:`qwenkit.model.losses.policy`. An entry also says what it cannot run (``refuses``)
and which ``grpo`` keys it alone reads (``keys``); the config check (``config/rules/grpo.py``) asks it.

Reductions (each a *share* of the whole optimizer step, over all ranks and micro-batches):

================  ========================================================  ==========================
reduction         per optimizer step                                        TRL's normaliser
================  ========================================================  ==========================
sequence_mean     mean over completions of ``sum_t l / n_b``                 per-sequence token mean
micro_batch_mean  mean over micro-batches of ``sum l / tokens of it``        the micro-batch's tokens
max_tokens        ``sum l / (completions x max_new_tokens)``                 a constant
token_mean        ``sum l / tokens``                                         the step's tokens
================  ========================================================  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass

REDUCTIONS = ("sequence_mean", "micro_batch_mean", "max_tokens", "token_mean")


@dataclass(frozen=True)
class PolicyLoss:
    surrogate: str  # "module:function" of qwenkit.model.losses.policy: (log-ratio, advantages, settings, log-probs, mask) -> Surrogate
    reduction: str  # one of REDUCTIONS
    peer: str  # where the formula comes from (the name users know it by)
    keys: tuple[str, ...] = ()  # grpo keys only this loss reads: set away from their defaults with another loss, refused
    refuses: tuple[tuple[str, str], ...] = ()  # (grpo key, why): keys this loss cannot run away from their defaults


_POLICY = "qwenkit.model.losses.policy"
_CLIPPED = f"{_POLICY}:clipped_surrogate"
_GEOMETRIC = "GMPO's ratio is already one per completion (the geometric mean of its tokens')"
_TIED = "the geometric mean ties each token's gradient to its whole completion; a per-token mask is not defined for it"
# grpo.loss_type: every value the config allows, in the order the docs list them
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "grpo": PolicyLoss(_CLIPPED, "sequence_mean", "TRL loss_type='grpo' (DeepSeekMath)"),
    "dr_grpo": PolicyLoss(_CLIPPED, "max_tokens", "TRL loss_type='dr_grpo' (Dr. GRPO)"),
    "dapo": PolicyLoss(_CLIPPED, "token_mean", "TRL loss_type='dapo' (DAPO's token-level mean)"),
    "bnpo": PolicyLoss(_CLIPPED, "micro_batch_mean", "TRL loss_type='bnpo'"),
    "cispo": PolicyLoss(f"{_POLICY}:cispo_surrogate", "token_mean", "TRL loss_type='cispo' (MiniMax-M1's CISPO)"),
    "sapo": PolicyLoss(f"{_POLICY}:sapo_surrogate", "sequence_mean", "TRL loss_type='sapo' (Qwen's SAPO)",
                       keys=("sapo_temperature_pos", "sapo_temperature_neg")),
    "gmpo": PolicyLoss(f"{_POLICY}:gmpo_surrogate", "sequence_mean", "GMPO (arXiv 2507.20673; not in TRL 1.16)",
                       refuses=(("importance_sampling_level", _GEOMETRIC), ("top_entropy_quantile", _TIED))),
}


def policy_loss(name: str) -> PolicyLoss:
    """The entry of ``grpo.loss_type`` ``name``; a ``ValueError`` naming the allowed values."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"grpo.loss_type must be one of {tuple(POLICY_LOSSES)}, got {name!r}")
    return POLICY_LOSSES[name]


__all__ = ["POLICY_LOSSES", "REDUCTIONS", "PolicyLoss", "policy_loss"]
