"""Where a run's model lives and the processor it reads data with: light enough for the launcher.

``data``, ``launch`` and ``checkpoint`` need the model directory and the processor, not the model's
code: this module imports transformers' tokenizer and image processor, never its modeling files.
Separate from :mod:`qwenkit.model.processor` because ``tiny`` may have to write the tiny checkpoint,
and :mod:`qwenkit.model.tiny.checkpoint` itself builds on the processor.
"""

from __future__ import annotations

from pathlib import Path

from qwenkit.model.families.entry import Family
from qwenkit.model.families.registry import TINY_DEFAULT
from qwenkit.model.processor import Processor
from qwenkit.model.tiny.checkpoint import ensure_checkpoint


def resolve_path(model_cfg) -> Path:
    """``tiny`` becomes the cached tiny checkpoint directory of the family; anything else must be a directory."""
    if model_cfg.path == "tiny":
        name = TINY_DEFAULT if model_cfg.name == "auto" else model_cfg.name
        return ensure_checkpoint(tie_word_embeddings=model_cfg.tie_word_embeddings, family=name)
    path = Path(model_cfg.path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={model_cfg.path!r}: no config.json there; give a local Hugging Face checkpoint directory "
            "(weights are never downloaded) or 'tiny'"
        )
    return path


def load_processor(cfg, model_dir: str | Path | None = None, family: Family | None = None) -> Processor:
    """A run's processor: ``model.path``'s tokenizer and image processor, ``data``'s pixel bounds;
    ``family``: the entry already resolved (:mod:`qwenkit.model.families.spec`), else ``model_dir``'s."""
    if model_dir is None:
        model_dir = resolve_path(cfg.model)
    return Processor.from_pretrained(model_dir, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels,
                                     family=family)  # fmt: skip
