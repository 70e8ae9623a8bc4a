"""The files of one run's folder (``train.output_dir``), named once.

::

    <output_dir>/
      config.yaml        the resolved config (the launcher; ``qwenkit export`` and the sweep read it)
      events.jsonl       what other programs need to know: started, resumed, step, ... (qwenkit.engine.run.events)
      parameters.json    total and trainable parameters per part (rank 0, before sharding)
      train.log          the launcher's console output, kept by whoever started it (sweep, notebooks)
      logs/rank-NNNNN.log  every rank's own log
      metrics/rank-NNNNN.jsonl  every rank's metrics (qwenkit.engine.run.metrics)
      checkpoints/       DCP checkpoints (qwenkit.engine.checkpoints.dcp)
      reward_failure.json  the rows, completions and tracebacks of a GRPO reward that failed (qwenkit.engine.objectives.rewards)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CONFIG = "config.yaml"
EVENTS = "events.jsonl"
PARAMETERS = "parameters.json"
TRAIN_LOG = "train.log"
LOGS = "logs"
METRICS = "metrics"
CHECKPOINTS = "checkpoints"
REWARD_FAILURE = "reward_failure.json"


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __init__(self, path: str | Path):
        object.__setattr__(self, "path", Path(path))

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def events(self) -> Path:
        return self.path / EVENTS

    @property
    def parameters(self) -> Path:
        return self.path / PARAMETERS

    @property
    def train_log(self) -> Path:
        return self.path / TRAIN_LOG

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def reward_failure(self) -> Path:
        return self.path / REWARD_FAILURE

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank:05d}.log"

    def is_run(self) -> bool:
        """Whether the folder holds anything a qwenkit run writes."""
        return any(p.exists() for p in (self.config, self.metrics, self.checkpoints, self.train_log))

    def parameter_counts(self) -> tuple[int, int] | None:
        """``(total, trainable)`` parameters from ``parameters.json`` (None: the run wrote none)."""
        if not self.parameters.is_file():
            return None
        parts = json.loads(self.parameters.read_text()).values()
        return sum(p["total"] for p in parts), sum(p["trainable"] for p in parts)
