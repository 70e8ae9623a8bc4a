"""The whole configuration (one section each) and the one validation pass over every section's rules.

Each section's fields and its ``check`` live in its own module (``config/model.py``, ...); a rule
that spans sections sits with the section whose key turns it on (``data.packing`` refuses
``loss.loss_type: sample_mean``; ``train.objective: dpo`` refuses packing).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qwenkit.config import checkpoint, data, dpo, grpo, lora, loss, model, parallel, profile, train, vllm
from qwenkit.config.checkpoint import CheckpointConfig
from qwenkit.config.data import DataConfig
from qwenkit.config.dpo import DpoConfig
from qwenkit.config.grpo import GrpoConfig
from qwenkit.config.lora import LoraConfig
from qwenkit.config.loss import LossConfig
from qwenkit.config.model import ModelConfig
from qwenkit.config.parallel import ParallelConfig
from qwenkit.config.profile import ProfileConfig
from qwenkit.config.train import TrainConfig
from qwenkit.config.vllm import VllmConfig

Need = Callable[[bool, str], None]  # validate's collector: need(condition, problem)
# each section's rules, in the order their problems are listed
CHECKS = (model.check, data.check, loss.check, parallel.check, train.check, lora.check, dpo.check, grpo.check,
          checkpoint.check, profile.check, vllm.check)  # fmt: skip


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def validate(cfg: Config, rewards: bool = True) -> list[str]:
    """Every range and cross-field rule, section by section; returns the problems (empty when valid).
    ``rewards``: import and check ``grpo.rewards`` (:func:`qwenkit.config.grpo.check_rewards`), which
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
