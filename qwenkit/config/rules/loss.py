"""The rules of ``loss``."""

from __future__ import annotations

from qwenkit.config.loss import chunk_size_problem
from qwenkit.config.schema import Config, Need


def check(cfg: Config, need: Need) -> None:
    loss = cfg.loss
    problem = chunk_size_problem(loss.chunk_size)
    need(problem is None, f"loss.{problem}")
    need(loss.chunk_budget_mb > 0, f"loss.chunk_budget_mb must be > 0, got {loss.chunk_budget_mb}")
    need(
        loss.loss_type != "raw",
        "loss.loss_type: 'raw' (unreduced per-token loss) is an API output "
        "(model.configure_loss(loss_type='raw')), not a training loss; use token_mean or sample_mean",
    )
