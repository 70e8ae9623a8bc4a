"""``checkpoint``: how often, how many kept, what a resume loads, and background saves."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (0: only at the end)
    keep_last: int = 2
    save_final: bool = True
    load_optimizer: bool = True
    load_rng: bool = True
    # YAML key checkpoint.async (a Python keyword, hence the field's name): stage the state to CPU
    # memory and write it in the background (DCP async_save) while training goes on
    async_save: bool = field(default=False, metadata={"key": "async"})
