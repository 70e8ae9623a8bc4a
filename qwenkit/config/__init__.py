"""Typed run configuration: one dataclass per section, YAML loading, dotted overrides, one validation pass.

A run is described by ``params/*.yaml`` plus command-line overrides such as ``train.steps=30``.
:func:`load` turns them into a :class:`Config` and validates everything (unknown keys, types,
ranges, illegal combinations) *before* any model is built. All problems found are reported
together in one :class:`ConfigError`, each naming the key path, the bad value and what is allowed.

Inside: ``loader`` (YAML 1.2, overrides, typing the values, :func:`load`, :func:`write_config`),
``schema`` (:class:`Config`), ``validate`` (:func:`validate`, the one pass), ``libraries`` (which
library an option needs), one module per section holding its fields and allowed names (``model``,
``data``, ``loss``, ``parallel``, ``train``, ``lora``, ``dpo``, ``grpo``, ``distill``, ``checkpoint``, ``profile``,
``vllm``) and ``rules/`` holding each section's rules under the same name.
"""

from qwenkit.config.checkpoint import CheckpointConfig
from qwenkit.config.data import DATA_LAYOUTS, DataConfig
from qwenkit.config.distill import DistillConfig
from qwenkit.config.dpo import DPO_LOSSES, DpoConfig
from qwenkit.config.grpo import BUILTIN_REWARDS, GRPO_LOSSES, GrpoConfig
from qwenkit.config.libraries import FUSED_LIBRARIES, PIP_NAMES, installed
from qwenkit.config.loader import BOOL_WORDS, ConfigError, Loader, load, parse_yaml, write_config
from qwenkit.config.lora import LoraConfig
from qwenkit.config.loss import LOSS_TYPES, TRAINING_LOSS_TYPES, LossConfig, chunk_size_problem
from qwenkit.config.model import (
    DTYPES,
    FUSED_BACKENDS,
    FUSED_OPS,
    MODEL_NAMES,
    Dtype,
    ModelConfig,
    fused_backend_problem,
    fused_ops_problems,
)  # fmt: skip
from qwenkit.config.parallel import ParallelConfig
from qwenkit.config.profile import ProfileConfig
from qwenkit.config.schema import Config
from qwenkit.config.train import (
    DATA_READS,
    EVAL_METRICS,
    OBJECTIVES,
    ObjectiveEntry,
    ParamGroupConfig,
    TrainConfig,
    load_user_metric,
    scorer_problems,
)  # fmt: skip
from qwenkit.config.validate import validate
from qwenkit.config.vllm import ENGINES, VllmConfig

__all__ = [
    "BOOL_WORDS", "BUILTIN_REWARDS", "ENGINES", "DATA_LAYOUTS", "DATA_READS", "DPO_LOSSES", "DTYPES", "EVAL_METRICS", "FUSED_BACKENDS", "FUSED_LIBRARIES",
    "FUSED_OPS", "GRPO_LOSSES", "LOSS_TYPES", "MODEL_NAMES", "OBJECTIVES", "PIP_NAMES", "TRAINING_LOSS_TYPES",
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DistillConfig", "DpoConfig", "Dtype", "GrpoConfig", "Loader", "LoraConfig",
    "LossConfig", "ModelConfig", "ObjectiveEntry", "ParallelConfig", "ParamGroupConfig", "ProfileConfig", "TrainConfig", "VllmConfig",
    "chunk_size_problem", "fused_backend_problem", "fused_ops_problems", "installed",
    "load", "load_user_metric", "parse_yaml", "scorer_problems", "validate", "write_config",
]  # fmt: skip
