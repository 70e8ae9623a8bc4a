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
