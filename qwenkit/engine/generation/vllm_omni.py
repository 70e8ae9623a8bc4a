"""An Omni thinker as vLLM 0.32 loads it: the directory its engine starts from, and the names of its pushed tensors.

vLLM's registry names the Omni models by their *whole* checkpoints only (``Qwen2_5OmniForConditionalGeneration``
mapped to its thinker class, which reads ``hf_config.thinker_config`` and ``thinker.``-prefixed weights,
``talker.`` and ``token2wav.`` dropped by its ``hf_to_vllm_mapper``); the kit trains the thinker alone
(:attr:`qwenkit.model.families.entry.Family.whole`). So the engine starts from a directory of its own
(:func:`engine_dir`, written once under the kit's cache, keyed by the checkpoint's files):

- ``config.json``: the whole's, ``thinker_config`` the thinker's (read from a thinker-only checkpoint, or the
  whole checkpoint's own), ``enable_audio_output: false`` (no talker is built);
- what HF's ``Qwen2_5OmniProcessor`` (vLLM's processor of the thinker) reads that the kit's files may lack: the
  tokenizer's media-token attributes (``image_token`` ... ``audio_eos_token``: without them ``TokenizersBackend
  has no attribute image_token``) and the kit's own feature extractor (:func:`qwenkit.data.audio.feature_extractor`:
  128 mel bins; without it vLLM extracts Whisper's 80 and fails inside the engine);
- the weights: a whole checkpoint's files linked as they are; a thinker-only checkpoint's none, the engine built
  with ``load_format="dummy"`` (every caller pushes the trainer's weights before it generates:
  :class:`qwenkit.engine.rollouts.vllm.VllmRollouts`, the evaluator, ``qwenkit eval``), where a copy of every
  tensor under ``thinker.`` would cost a second checkpoint on disk.

A push names each tensor as the whole checkpoint does (:func:`whole_name`): transformers' own reversal of its load
mapping (what ``save_pretrained`` writes: ``model.language_model.`` -> ``model.`` on transformers >= 5.23), under
the part's prefix (``thinker.``); vLLM's mapper takes it from there.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

from qwenkit.data import audio
from qwenkit.model.families import registry as families
from qwenkit.model.tiny.data import cache_root

VERSION = 2  # bumped when what engine_dir writes changes
WEIGHTS = (".safetensors", ".safetensors.index.json")
# HF's Qwen2_5OmniProcessor reads these tokenizer attributes; the kit's processor's ids of each
MEDIA_TOKENS = {"image_token": "image_token_id", "video_token": "video_token_id",
                "vision_bos_token": "vision_start_id", "vision_eos_token": "vision_end_id"}  # fmt: skip
AUDIO_TOKENS = ("audio_bos_token", "audio_token", "audio_eos_token")  # the entry's audio_tokens, in order


def engine_dir(family, processor, model_dir: str | Path) -> tuple[str, str]:
    """``(directory, load_format)`` vLLM starts ``model_dir`` (a checkpoint of ``family``) from: the directory
    itself for a family that is no part of a whole model, else the whole's (module docstring)."""
    if family.whole is None:
        return str(model_dir), "auto"
    src = Path(model_dir).resolve()
    config = families.checkpoint_config(src)
    whole = config.get("model_type") == family.whole.model_type
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in src.iterdir() if p.is_file())
    key = hashlib.sha1(json.dumps([VERSION, str(src), files]).encode()).hexdigest()[:12]
    out = cache_root() / f"vllm-{family.name}-{key}"
    if not (out / "config.json").is_file():
        _write(family, processor, src, config, whole, out)
    return str(out), "auto" if whole else "dummy"


def _write(family, processor, src: Path, config: dict, whole: bool, out: Path) -> None:
    """The directory of :func:`engine_dir`, written beside ``out`` and renamed (ranks may race to it)."""
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and p.name not in ("config.json", "tokenizer_config.json", "preprocessor_config.json") and (
            whole or not p.name.endswith(WEIGHTS)
        ):
            (tmp / p.name).symlink_to(p)
    hf_class = family.whole.hf_class.rpartition(":")[2]
    if whole:
        config = {**config, "enable_audio_output": False}
    else:
        config = {"architectures": [hf_class], "model_type": family.whole.model_type,
                  f"{family.whole.part}_config": config, "enable_audio_output": False}  # fmt: skip
    vision = config[f"{family.whole.part}_config"].get("vision_config", {})
    if "num_position_embeddings" in vision and "image_size" not in vision:
        # vLLM's Qwen3-Omni tower reads two keys Qwen's published configs carry and transformers' config class does
        # not: image_size, its position grid's side (HF's: sqrt(num_position_embeddings)) in pixels, and whether it adds
        # those absolute positions (HF's tower always does)
        vision["image_size"] = math.isqrt(vision["num_position_embeddings"]) * vision["patch_size"]
        vision.setdefault("apply_vit_abs_pos_embed", True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    ids = {name: getattr(processor, attr) for name, attr in MEDIA_TOKENS.items()}
    ids |= dict(zip(AUDIO_TOKENS, processor.audio_ids))
    named = {name: processor.tokenizer.convert_ids_to_tokens(i) for name, i in ids.items()}
    tok["extra_special_tokens"] = {**tok.get("extra_special_tokens", {}), **named}
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    pre = json.loads((src / "preprocessor_config.json").read_text())
    extractor = audio.feature_extractor().to_dict()
    extractor.pop("mel_filters", None)  # computed from feature_size and the others
    (tmp / "preprocessor_config.json").write_text(json.dumps({**extractor, **pre}, indent=2))
    try:
        tmp.rename(out)
    except OSError:  # another rank's came first: the same files
        if not (out / "config.json").is_file():
            raise


def whole_name(model, family, name: str, tensor) -> str:
    """``name`` (a parameter of ``model``, a part of ``family``'s whole model) as the whole checkpoint holds it
    (module docstring); ``name`` itself for a family that is no part of one."""
    if family.whole is None:
        return name
    from transformers.core_model_loading import revert_weight_conversion

    saved = list(revert_weight_conversion(model, {name: tensor}))
    if len(saved) != 1:  # fused experts the whole checkpoint holds per expert: Qwen3-Omni's, refused on vLLM (its entry)
        raise ValueError(f"{name}: {family.whole.model_type} checkpoints hold it as {len(saved)} tensors; the push "
                         "sends one per parameter")  # fmt: skip
    return saved[0] if saved[0].startswith(family.whole.prefix) else family.whole.prefix + saved[0]


__all__ = ["engine_dir", "whole_name"]
