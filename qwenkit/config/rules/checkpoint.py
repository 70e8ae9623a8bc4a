"""The rules of ``checkpoint``."""

from __future__ import annotations

import torch

from qwenkit.config.schema import Config, Need


def check(cfg: Config, need: Need) -> None:
    ckpt = cfg.checkpoint
    need(ckpt.every >= 0, f"checkpoint.every must be >= 0, got {ckpt.every}")
    need(ckpt.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {ckpt.keep_last}")
    if ckpt.async_save:
        import torch.distributed.checkpoint as dcp

        need(hasattr(dcp, "async_save"), f"checkpoint.async=true needs torch.distributed.checkpoint.async_save "
             f"(torch >= 2.4), this torch is {torch.__version__}: set checkpoint.async=false or upgrade torch")  # fmt: skip
