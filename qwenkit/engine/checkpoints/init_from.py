"""``model.init_from``: start a run from another run's checkpoint (preference tuning after SFT).

DPO starts from a supervised fine-tune; its reference is that starting point. ``model.init_from``
names the SFT run (its ``output_dir``, whose newest complete checkpoint is taken, or one
``step-N`` directory). Before any rank starts, the launcher (:func:`prepare`):

1. finds the checkpoint; when the run has none and ``model.init_recipe`` names a params file,
   trains that first (``qwenkit train --config <recipe> train.output_dir=<init_from>``, the same
   ranks), so a fresh clone's ``params/tiny_dpo_cpu.yaml`` makes its own SFT start;
2. exports it once as a full HF directory ``<init_from>/hf-<step-N>`` (LoRA adapters merged),
   reused by every later start (a resume, another DPO run from the same SFT);
3. sets ``model.path`` to that directory: the run's ``config.yaml`` then records the weights it
   started from, and ``qwenkit export`` / ``qwenkit eval`` of the DPO run find its base there.

A missing run without a recipe, or a recipe that is not a file, is one line (exit 2).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

from qwenkit import config as qconfig
from qwenkit.engine.checkpoints import folder as checkpoint_dir

log = logging.getLogger(__name__)


def problem(model_cfg) -> str | None:
    """What is wrong with ``model.init_from`` / ``model.init_recipe`` before anything is trained, or None."""
    if not model_cfg.init_from:
        return "model.init_recipe is set but model.init_from is not: the recipe trains the run init_from names" \
            if model_cfg.init_recipe else None  # fmt: skip
    if model_cfg.init_recipe and not Path(model_cfg.init_recipe).is_file():
        return f"model.init_recipe={model_cfg.init_recipe!r} is not a file (a params/*.yaml that trains model.init_from)"
    if not model_cfg.init_recipe and _checkpoint(model_cfg.init_from) is None:
        return (f"model.init_from={model_cfg.init_from!r}: no complete checkpoint there; train that run first, "
                "or set model.init_recipe to the params file that trains it")  # fmt: skip
    return None


def _checkpoint(path: str) -> Path | None:
    try:
        return checkpoint_dir.resolve(Path(path).expanduser())
    except checkpoint_dir.CheckpointError:
        return None


def export_dir(checkpoint: Path) -> Path:
    """Where the start taken from ``checkpoint`` is exported: ``<its run>/hf-<step-N>``."""
    return checkpoint.parent.parent / f"hf-{checkpoint.name}"


def prepare(cfg, train_recipe: Callable[[str, list[str]], int]) -> int | None:
    """Point ``cfg.model.path`` at ``model.init_from``'s export (training and exporting it when
    needed, see the module docstring); an exit status to stop with, or None to go on.

    ``train_recipe(params_file, overrides)`` runs ``qwenkit train`` (the launcher passes its own).
    """
    m = cfg.model
    said = problem(m)  # before the early return: a recipe without init_from is refused, not ignored
    if said:
        print(f"qwenkit train: {said}", file=sys.stderr)
        return 2
    if not m.init_from:
        return None
    ckpt = _checkpoint(m.init_from)
    if ckpt is None:
        print(f"qwenkit train: model.init_from={m.init_from!r} has no checkpoint yet: training it first with "
              f"{m.init_recipe}", flush=True)  # fmt: skip
        code = train_recipe(m.init_recipe, [f"train.output_dir={m.init_from}"])
        ckpt = _checkpoint(m.init_from)
        if code != 0 or ckpt is None:
            print(f"qwenkit train: the SFT start ({m.init_recipe} into {m.init_from}) did not finish "
                  f"(exit {code}); run it again to continue it", file=sys.stderr)  # fmt: skip
            return code or 1
    m.path = str(export_once(ckpt, "model.init_from"))
    return None


def export_once(ckpt: Path, key: str) -> Path:
    """``ckpt`` as a full HF directory (:func:`export_dir`, LoRA merged), exported on the first call only
    (``key``: the setting that asked, for the console line)."""
    out = export_dir(ckpt)
    if not (out / "config.json").is_file():
        from qwenkit.engine.checkpoints import export  # loads DCP: here only, the launcher stays light

        trained = qconfig.load(checkpoint_dir.run_config_path(ckpt))
        export.export(ckpt, out, trained, merge=True, overwrite=out.exists())
        print(f"qwenkit train: {key}: exported {ckpt} to {out}", flush=True)
    return out


__all__ = ["export_dir", "export_once", "prepare", "problem"]
