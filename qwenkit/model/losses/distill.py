"""On-policy distillation's loss of per-token log-probs: the reverse KL to a teacher on the student's own samples.

The student samples a completion ``y ~ p_s``; at each completion token ``t`` the teacher scores the
sampled token, and (Thinking Machines' on-policy distillation, Tinker cookbook ``distillation``) the
per-token advantage is the negative reverse KL estimate of that token::

    k_t = logp_s(y_t) - logp_t(y_t)          # one sample of KL(p_s || p_t) at position t
    A_t = -k_t                               # the advantage, no gradient (discount 0: the token's own)

and the loss is the on-policy importance-sampling loss of that advantage (Tinker's ``importance_sampling``)::

    l_t = -w_t * exp(logp_s - sg(logp_s)) * sg(A_t) = w_t * exp(logp_s - sg(logp_s)) * sg(k_t)

whose value is ``w_t k_t`` (the ratio is 1 on-policy: the loss reads as the sampled reverse KL and falls as
the student nears the teacher) and whose gradient is ``w_t k_t grad logp_s``: the score-function
estimate of ``grad KL(p_s || p_t)`` per token. ``w_t`` is the truncated importance weight of the
trainer's and the sampler's log-probs (vLLM's, or a lower-precision rollout's:
:func:`qwenkit.model.losses.policy.vllm_importance_weights`), 1 otherwise. It is the sampled-token form of TRL
GKD's ``lmbda=1, beta=1`` (on-policy, reverse KL); GKD sums the KL over the vocabulary instead, which would
need both models' ``[T, V]`` distributions (here both models give per-token log-probs from their chunked
heads only, never logits).

The reduction is the token mean over the optimizer step's completion tokens (all ranks, all
micro-batches; ``tokens``), as a share, so world size and accumulation change nothing.
"""

from __future__ import annotations

import torch


def reverse_kl_loss(logps: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, tokens: int | torch.Tensor,
                    weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(loss share, k [B, T] detached)`` of the module docstring. ``logps``: the student's log-probs of the
    sampled tokens ``[B, T]``; ``teacher``: the teacher's, same shape; ``mask``: the completion tokens;
    ``tokens``: the step's completion tokens over every rank; ``weights``: importance weights ``[B, T]``
    or ``[B, 1]`` (sequence level), or None."""
    mask = mask.to(logps.dtype)
    k = ((logps.detach() - teacher) * mask).detach()  # [B, T] the per-token reverse KL samples
    per_token = torch.exp(logps - logps.detach()) * k  # value k, gradient k * grad logp
    if weights is not None:
        per_token = per_token * weights
    loss = (per_token * mask).sum() / torch.as_tensor(tokens, dtype=logps.dtype, device=logps.device).clamp(min=1.0)
    return loss, k
