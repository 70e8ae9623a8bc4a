"""``checkpoint``: how often, how many kept, what a resume loads, and background saves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qwenkit.config.schema import Config, Need


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


def check(cfg: Config, need: Need) -> None:
    ckpt = cfg.checkpoint
    need(ckpt.every >= 0, f"checkpoint.every must be >= 0, got {ckpt.every}")
    need(ckpt.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {ckpt.keep_last}")
    if ckpt.async_save:
        import torch.distributed.checkpoint as dcp

        need(hasattr(dcp, "async_save"), f"checkpoint.async=true needs torch.distributed.checkpoint.async_save "
             f"(torch >= 2.4), this torch is {torch.__version__}: set checkpoint.async=false or upgrade torch")  # fmt: skip
