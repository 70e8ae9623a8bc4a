"""The losses, math of hidden states, weights and log-probs, no model and no engine.

- :mod:`~qwenkit.model.losses.cross_entropy`: the chunked linear cross-entropy (SFT; the head's loss
  without full logits) and its reductions;
- :mod:`~qwenkit.model.losses.logps`: token and sequence log-probs from the same chunked pass (GRPO, DPO);
- :mod:`~qwenkit.model.losses.registry`: the policy losses by name (``grpo.loss_type``): a light table that
  the config reads; :mod:`~qwenkit.model.losses.policy`: their math (GRPO and its kin);
- :mod:`~qwenkit.model.losses.preference`: DPO and its kin;
- :mod:`~qwenkit.model.losses.distill`: on-policy distillation (the sampled reverse KL to a teacher).

A new RL loss is one entry in ``registry`` and its function in ``policy``.
"""
