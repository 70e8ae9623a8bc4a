"""A checkpoint as a Hugging Face model: gathered in one process, written as an HF directory.

:func:`load_hf` reads every DCP shard into HF's own ``Qwen2_5_VLForConditionalGeneration`` (the
class users deploy), without a process group; :func:`export` saves it with ``save_pretrained`` and
copies the base model's tokenizer and processor files beside it.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp

from qwenkit.config import DTYPES
from qwenkit.distributed.meta import build_on_meta, set_buffer, tied_groups
from qwenkit.engine.checkpoint import CheckpointError, resolve
from qwenkit.model.paths import resolve_path

log = logging.getLogger(__name__)


# Non-weight files of an HF checkpoint directory that the export copies from the base model.
PROCESSOR_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "video_preprocessor_config.json", "processor_config.json", "generation_config.json",
)


def export(checkpoint: str | Path, out: str | Path, cfg) -> Path:
    """Write a checkpoint's model as an HF directory (safetensors, config, processor files).

    Runs in one process without a process group (see :func:`load_hf`); ``save_pretrained``
    writes HF's own key layout, so ``from_pretrained`` loads it back.
    """
    out = Path(out)
    base = resolve_path(cfg.model)
    hf = load_hf(checkpoint, cfg)
    hf.save_pretrained(out)
    for name in PROCESSOR_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)
    log.debug("exported %s to %s", resolve(checkpoint), out)
    return out


def load_hf(checkpoint: str | Path, cfg):
    """A checkpoint's model as a plain ``Qwen2_5_VLForConditionalGeneration`` on the CPU.

    Runs in one process without a process group: DCP gathers every shard into full tensors of
    the HF model built with parameters on meta, then given CPU storage. Non-persistent buffers
    (rotary ``inv_freq``) are in no checkpoint: they keep the values computed at construction.
    """
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration  # modeling: export and eval only

    ckpt = resolve(checkpoint)
    base = resolve_path(cfg.model)
    config = AutoConfig.from_pretrained(base, local_files_only=True)
    hf = build_on_meta(Qwen2_5_VLForConditionalGeneration, config)
    buffers = {name: buf.clone() for name, buf in hf.named_buffers()}
    hf.to_empty(device="cpu")
    hf.to(DTYPES[cfg.model.dtype])
    for name, buf in buffers.items():
        set_buffer(hf, name, buf)
    state = hf.state_dict()
    saved = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    wanted = {k: v for k, v in state.items() if f"model.{k}" in saved}
    tied = {n for group in tied_groups(hf) if any(n in wanted for n in group) for n in group}  # one name saved
    missing = sorted(set(state) - set(wanted) - tied)
    if missing:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks model tensors: {', '.join(missing[:5])}")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load({"model": wanted}, checkpoint_id=str(ckpt), no_dist=True)
    return hf
