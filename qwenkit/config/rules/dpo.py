"""The rules of ``dpo``."""

from __future__ import annotations

import dataclasses

from qwenkit.config.dpo import DpoConfig
from qwenkit.config.schema import Config, Need


def check(cfg: Config, need: Need) -> None:
    """``train.objective`` and the ``dpo`` section, and what preference pairs cannot go with."""
    dpo = cfg.dpo
    if cfg.train.objective != "dpo":
        changed = [f.name for f in dataclasses.fields(DpoConfig) if getattr(dpo, f.name) != f.default]
        need(not changed, f"dpo.{', dpo.'.join(changed)} set but train.objective={cfg.train.objective!r}; set train.objective=dpo")
        return
    need(dpo.beta > 0, f"dpo.beta must be > 0, got {dpo.beta}")
    need(0.0 <= dpo.label_smoothing < 0.5, f"dpo.label_smoothing must be in [0, 0.5), got {dpo.label_smoothing}")
    need(
        dpo.label_smoothing == 0 or dpo.loss in ("sigmoid", "simpo"),
        f"dpo.label_smoothing applies to dpo.loss sigmoid or simpo, not {dpo.loss!r}",
    )
    need(dpo.gamma >= 0, f"dpo.gamma must be >= 0, got {dpo.gamma}")
    need(dpo.gamma == 0 or dpo.loss == "simpo", f"dpo.gamma (the SimPO margin) applies to dpo.loss=simpo, not {dpo.loss!r}")
    need(dpo.sft_weight >= 0, f"dpo.sft_weight must be >= 0, got {dpo.sft_weight}")
    need(
        not (dpo.precompute_ref and dpo.loss == "simpo"),
        "dpo.precompute_ref=true with dpo.loss=simpo: SimPO has no reference model to precompute",
    )
    need(cfg.loss.chunk, "train.objective=dpo needs loss.chunk=true: the per-sequence log-probs come from the chunked head")
    need(
        not cfg.data.max_tokens_per_batch,
        "train.objective=dpo does not support data.max_tokens_per_batch yet (the token-budget sampler deals samples, "
        "not pairs); use train.micro_batch_size (pairs per micro-batch)",
    )
    need(
        cfg.data.eval_fraction == 0.0,
        "train.objective=dpo does not support data.eval_fraction (it would split rows, not pairs); "
        "hold out pairs with data.eval_path",
    )
    need(
        cfg.data.layout == "auto",
        f"train.objective=dpo reads the preference layouts (TRL, LLaMA-Factory, ms-swift; docs/DATA.md) per row: "
        f"data.layout must be auto, got {cfg.data.layout!r}",
    )
