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
from qwenkit.model import lora
from qwenkit.model.paths import resolve_path

log = logging.getLogger(__name__)


# Non-weight files of an HF checkpoint directory that the export copies from the base model.
PROCESSOR_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "video_preprocessor_config.json", "processor_config.json", "generation_config.json",
)


def export(checkpoint: str | Path, out: str | Path, cfg, merge: bool = False) -> Path:
    """Write a checkpoint's model as an HF directory (safetensors, config, processor files).

    Runs in one process without a process group (see :func:`load_hf`); ``save_pretrained``
    writes HF's own key layout, so ``from_pretrained`` loads it back. A LoRA run (``lora.r >
    0``) writes peft's adapter directory (``adapter_config.json`` naming the base model,
    ``adapter_model.safetensors`` in peft's key names), which ``PeftModel.from_pretrained`` on
    the base model loads; ``merge``: a full HF directory with the adapters merged instead.
    """
    out = Path(out)
    base = resolve_path(cfg.model)
    if cfg.lora.r > 0 and not merge:
        load_peft(checkpoint, cfg).save_pretrained(out)
    else:
        load_hf(checkpoint, cfg).save_pretrained(out)
    for name in PROCESSOR_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)
    log.debug("exported %s to %s", resolve(checkpoint), out)
    return out


def load_peft(checkpoint: str | Path, cfg):
    """A LoRA run's checkpoint as peft's ``PeftModel`` on HF's class (base weights from ``model.path``).

    peft builds its own adapters (same targets, rank, saved modules) on the base model; the
    checkpoint's trained tensors are then read into them by name: qwenkit's keys are the
    PeftModel's without ``base_model.model.`` and with a saved module's ``modules_to_save.default``
    segment dropped (qwenkit trains the module itself, peft a copy of it).
    """
    from peft import get_peft_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    ckpt = resolve(checkpoint)
    base = resolve_path(cfg.model)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(base, dtype=DTYPES[cfg.model.dtype], local_files_only=True)
    targets, _ = lora.target_problems(hf, cfg.lora)
    config = lora.peft_config(cfg.lora, targets, modules_to_save=True)
    config.base_model_name_or_path = str(base)
    peft_model = get_peft_model(hf, config)
    saved = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    wanted, missing = {}, []
    for name, param in peft_model.named_parameters():
        if not param.requires_grad:
            continue
        key = name.removeprefix("base_model.model.").replace(f".modules_to_save.{lora.ADAPTER}.", ".")
        if f"model.{key}" in saved:
            wanted[key] = param.data
        else:
            missing.append(key)
    if missing:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks trained tensors: {', '.join(missing[:5])}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load({"model": wanted}, checkpoint_id=str(ckpt), no_dist=True)
    return peft_model


def load_hf(checkpoint: str | Path, cfg):
    """A checkpoint's model as a plain ``Qwen2_5_VLForConditionalGeneration`` on the CPU.

    A LoRA run's is its :func:`load_peft` model with the adapters merged (peft's ``merge_and_unload``).

    Runs in one process without a process group: DCP gathers every shard into full tensors of
    the HF model built with parameters on meta, then given CPU storage. Non-persistent buffers
    (rotary ``inv_freq``) are in no checkpoint: they keep the values computed at construction.
    """
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration  # modeling: export and eval only

    if cfg.lora.r > 0:
        return load_peft(checkpoint, cfg).merge_and_unload()
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
