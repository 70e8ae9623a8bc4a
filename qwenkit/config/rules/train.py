"""The rules of ``train``."""

from __future__ import annotations

import logging

from qwenkit.config.libraries import installed
from qwenkit.config.schema import Config, Need
from qwenkit.config.train import scorer_problems

log = logging.getLogger(__name__)


def check(cfg: Config, need: Need) -> None:
    train = cfg.train
    need(train.steps > 0, f"train.steps must be > 0, got {train.steps}")
    need(
        0 <= train.stop_after <= train.steps,
        f"train.stop_after must be in [0, train.steps={train.steps}], got {train.stop_after}",
    )
    need(train.micro_batch_size > 0, f"train.micro_batch_size must be > 0, got {train.micro_batch_size}")
    need(train.grad_accum > 0, f"train.grad_accum must be > 0, got {train.grad_accum}")
    need(train.lr > 0, f"train.lr must be > 0, got {train.lr}")
    need(0.0 <= train.min_lr_ratio <= 1.0, f"train.min_lr_ratio must be in [0, 1], got {train.min_lr_ratio}")
    need(train.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {train.warmup_steps}")
    if train.warmup_steps > train.steps > 0:
        log.warning(
            "train.warmup_steps=%d exceeds train.steps=%d: the LR rises for the whole run and never reaches train.lr=%g",
            train.warmup_steps, train.steps, train.lr,
        )  # fmt: skip
    need(
        bool(train.output_dir.strip()),
        f"train.output_dir must name a directory, got {train.output_dir!r} "
        "(empty: config.yaml, checkpoints/, logs/ and metrics/ would land in the current directory)",
    )
    need(train.weight_decay >= 0, f"train.weight_decay must be >= 0, got {train.weight_decay}")
    need(
        len(train.betas) == 2 and all(0.0 <= b < 1.0 for b in train.betas),
        f"train.betas must be two numbers in [0, 1), got {train.betas}",
    )
    need(train.max_grad_norm >= 0, f"train.max_grad_norm must be >= 0, got {train.max_grad_norm}")
    need(train.log_every >= 1, f"train.log_every must be >= 1, got {train.log_every}")
    need(train.eval_every >= 0, f"train.eval_every must be >= 0, got {train.eval_every}")
    need(train.eval_samples >= 0, f"train.eval_samples must be >= 0, got {train.eval_samples}")
    need(train.eval_accuracy_every >= 0, f"train.eval_accuracy_every must be >= 0, got {train.eval_accuracy_every}")
    need(train.eval_max_new_tokens >= 1, f"train.eval_max_new_tokens must be >= 1, got {train.eval_max_new_tokens}")
    need(train.eval_batch_size >= 1, f"train.eval_batch_size must be >= 1, got {train.eval_batch_size}")
    need(train.eval_temperature >= 0, f"train.eval_temperature must be >= 0 (0: greedy), got {train.eval_temperature}")
    need(0 < train.eval_top_p <= 1, f"train.eval_top_p must be in (0, 1], got {train.eval_top_p}")
    for problem in scorer_problems(train.eval_metrics, "train.eval_metrics"):
        need(False, problem)
    need(
        "mlflow" not in train.report_to or installed("mlflow"),
        "train.report_to: mlflow needs the mlflow package, which is not installed; pip install 'qwenkit[mlflow]'",
    )
    _check_param_groups(cfg, need)


def _check_param_groups(cfg: Config, need: Need) -> None:
    seen = set()
    for i, group in enumerate(cfg.train.param_groups):
        key = f"train.param_groups[{i}]"
        need(bool(group.pattern), f"{key}.pattern must be a module path, e.g. model.visual.blocks.*")
        need(group.pattern not in seen, f"{key}.pattern {group.pattern!r} is given twice")
        seen.add(group.pattern)
        need(group.lr > 0, f"{key}.lr must be > 0, got {group.lr}")
        if group.weight_decay is not None:
            need(group.weight_decay >= 0, f"{key}.weight_decay must be >= 0, got {group.weight_decay}")
