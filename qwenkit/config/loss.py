"""``loss``: the chunked head's cross-entropy and how it is reduced."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

TRAINING_LOSS_TYPES = ("token_mean", "sample_mean")  # what the chunked head computes
LOSS_TYPES = (*TRAINING_LOSS_TYPES, "raw")  # loss.loss_type; raw (unreduced, per token): an API output, not for training


@dataclass
class LossConfig:
    chunk: bool = True  # chunked cross-entropy in the lm_head: full [B, S, V] logits never exist
    chunk_size: int | Literal["auto"] = "auto"  # labelled tokens per logits chunk (ignored ones are skipped)
    chunk_budget_mb: int = 512  # memory budget of one fp32 logits chunk, for chunk_size=auto
    # "raw" (unreduced per-token loss) is an API output (model.configure_loss), never a training loss
    loss_type: Literal[LOSS_TYPES] = "token_mean"


def chunk_size_problem(chunk_size: Any) -> str | None:
    """Why a ``loss.chunk_size`` value is refused (a positive int or ``auto``), or None."""
    if chunk_size == "auto" or (isinstance(chunk_size, int) and chunk_size > 0):
        return None
    return f"chunk_size must be a positive int or 'auto', got {chunk_size!r}"
