"""``profile``: the torch.profiler window and the allocator's memory history."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qwenkit.config.schema import Config, Need


@dataclass
class ProfileConfig:
    enabled: bool = False  # torch.profiler window
    wait: int = 1
    warmup: int = 1
    active: int = 2
    memory_snapshot: bool = False  # CUDA/NPU allocator history; peak RSS on CPU is always recorded


def check(cfg: Config, need: Need) -> None:
    profile = cfg.profile
    for name in ("wait", "warmup"):
        need(getattr(profile, name) >= 0, f"profile.{name} must be >= 0, got {getattr(profile, name)}")
    need(profile.active >= 1, f"profile.active must be >= 1, got {profile.active}")
