"""The rules of ``model``."""

from __future__ import annotations

from qwenkit.config.model import fused_backend_problem, fused_ops_problems
from qwenkit.config.schema import Config, Need


def check(cfg: Config, need: Need) -> None:
    model = cfg.model
    for problem in fused_ops_problems(model.fused_ops):
        need(False, f"model.fused_ops: {problem}")
    if model.fused_ops != "off":
        problem = fused_backend_problem(model.fused_backend)
        need(problem is None, f"model.{problem}")
    mtp = model.mtp
    if mtp.train:
        need(mtp.loss_weight > 0, f"model.mtp.loss_weight must be > 0 when model.mtp.train, got {mtp.loss_weight}")
        need(mtp.layers >= 0, f"model.mtp.layers must be >= 0 (0: all the checkpoint's), got {mtp.layers}")
        need(cfg.train.objective == "sft", f"model.mtp.train: train.objective={cfg.train.objective!r} has no MTP "
             "loss (its log-probs come from the main head alone); use train.objective=sft or model.mtp.train=false")
        need(cfg.loss.chunk, "model.mtp.train needs loss.chunk=true (the MTP loss goes through the chunked head)")
