"""``dpo``: preference tuning (``train.objective: dpo``) and what preference pairs cannot go with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DPO_LOSSES = ("sigmoid", "ipo", "hinge", "simpo")  # dpo.loss; qwenkit.model.losses.preference implements them


@dataclass
class DpoConfig:
    """Preference tuning (``train.objective: dpo``); the losses are in :mod:`qwenkit.model.losses.preference`."""

    beta: float = 0.1  # strength of the pull towards the reference (SimPO: the reward scale)
    loss: Literal[DPO_LOSSES] = "sigmoid"  # sigmoid (DPO), ipo, hinge (SLiC), simpo (no reference, length-normalised)
    gamma: float = 0.0  # simpo only: the target reward margin
    label_smoothing: float = 0.0  # sigmoid / simpo: the share of pairs assumed flipped (conservative DPO)
    sft_weight: float = 0.0  # > 0: add this x the chosen replies' token-mean cross-entropy (RPO, pref_ftx)
    # one pass before training writes the reference's log-probs of every pair next to the data
    # index (keyed by its fingerprint); no reference forward in training, no reference copy
    precompute_ref: bool = False
