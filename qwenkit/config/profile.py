"""``profile``: the torch.profiler window and the allocator's memory history."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProfileConfig:
    enabled: bool = False  # torch.profiler window
    wait: int = 1
    warmup: int = 1
    active: int = 2
    memory_snapshot: bool = False  # CUDA/NPU allocator history; peak RSS on CPU is always recorded
