"""The model a run trains: the family's chunk-loss subclass (:func:`qwenkit.model.registry.build`)
with the run's fused ops where the family's entry says they fit (:func:`qwenkit.patches.apply`).
The policy (:mod:`qwenkit.engine.run.train`) and DPO's frozen copy of it
(:func:`qwenkit.engine.objectives.dpo.frozen_copy`) are built by this one call, so the two compute alike."""

from __future__ import annotations

from qwenkit import patches
from qwenkit.model import family, registry
from qwenkit.model.chunked import ChunkLossMixin


def fused_model(cfg) -> ChunkLossMixin:
    """``registry.build(cfg.model, cfg.loss)``, then ``model.fused_backend``/``model.fused_ops``
    (the patch report is logged)."""
    model = registry.build(cfg.model, cfg.loss)
    patches.apply(model, backend=cfg.model.fused_backend, ops=cfg.model.fused_ops,
                  applicable=family.of_model(model).fused_ops)  # fmt: skip
    return model
