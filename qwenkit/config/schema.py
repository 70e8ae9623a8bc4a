"""The whole configuration: one dataclass per section, each defined in its own module (``config/model.py``, ...)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qwenkit.config.checkpoint import CheckpointConfig
from qwenkit.config.data import DataConfig
from qwenkit.config.distill import DistillConfig
from qwenkit.config.dpo import DpoConfig
from qwenkit.config.grpo import GrpoConfig
from qwenkit.config.lora import LoraConfig
from qwenkit.config.loss import LossConfig
from qwenkit.config.model import ModelConfig
from qwenkit.config.parallel import ParallelConfig
from qwenkit.config.profile import ProfileConfig
from qwenkit.config.train import TrainConfig
from qwenkit.config.vllm import VllmConfig

Need = Callable[[bool, str], None]  # validate's collector: need(condition, problem); every rule takes it


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
    distill: DistillConfig = field(default_factory=DistillConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
