"""The one validation pass: every range and cross-field rule, section by section (``config/rules/``)."""

from __future__ import annotations

import dataclasses
import math

from qwenkit.config.rules import (
    checkpoint,
    data,
    distill,
    dpo,
    grpo,
    lora,
    loss,
    model,
    parallel,
    profile,
    train,
    vllm,
)
from qwenkit.config.schema import Config, Need

# each section's rules, in the order their problems are listed
CHECKS = (model.check, data.check, loss.check, parallel.check, train.check, lora.check, dpo.check, grpo.check, distill.check,
          checkpoint.check, profile.check, vllm.check)  # fmt: skip


def validate(cfg: Config, rewards: bool = True) -> list[str]:
    """Every range and cross-field rule, section by section; returns the problems (empty when valid).
    ``rewards``: import and check ``grpo.rewards`` (:func:`qwenkit.config.rules.grpo.check_rewards`), which
    only a command that calls them needs."""
    problems: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    for check in (_check_finite, *CHECKS):
        check(cfg, need)
    if rewards:
        grpo.check_rewards(cfg, need)
    return problems


def _check_finite(cfg: Config, need: Need) -> None:
    """No float setting is inf or nan (``train.lr: .inf`` would pass ``lr > 0``)."""
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                need(False, f"{section.name}.{f.name} must be a finite number, got {value}")
