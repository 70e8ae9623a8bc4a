"""qwenkit.engine.generation.vllm_omni without vLLM: the directory an Omni thinker's engine starts from is one HF's
classes of the whole model read (its config with the thinker's; what HF's ``Qwen2_5OmniProcessor`` reads: the kit's
media tokens and 128 mel bins), a whole checkpoint's weights linked and a thinker-only one's left to the first push; and a
push names every thinker tensor as the whole checkpoint holds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_processor

from qwenkit.engine.generation.vllm_omni import engine_dir, whole_name
from qwenkit.model.families import registry as families
from qwenkit.model.tiny.checkpoint import ensure_checkpoint

FAMILY = "qwen2_5_omni"
pytestmark = pytest.mark.skipif(bool(families.get(FAMILY).unavailable()), reason="transformers 4.x has no Qwen2.5-Omni")


@pytest.mark.parametrize("whole", [False, True], ids=["thinker-only", "whole"])
def test_the_engine_directory_is_the_whole_model_hfs_processor_reads(_cache, whole):
    from transformers import AutoTokenizer, Qwen2_5OmniConfig, WhisperFeatureExtractor

    family, processor = families.get(FAMILY), tiny_processor(FAMILY)
    path = ensure_checkpoint(family=FAMILY, whole=whole)
    out, load_format = engine_dir(family, processor, path)
    assert load_format == ("auto" if whole else "dummy")
    config = Qwen2_5OmniConfig.from_pretrained(out)
    assert config.architectures == ["Qwen2_5OmniForConditionalGeneration"] and not config.enable_audio_output
    thinker = json.loads((path / "config.json").read_text())
    thinker = thinker["thinker_config"] if whole else thinker
    assert json.loads((Path(out) / "config.json").read_text())["thinker_config"] == thinker
    # what HF's Qwen2_5OmniProcessor reads of them (its video processor needs torchvision: not in this venv)
    hf, tok = AutoTokenizer.from_pretrained(out), processor.tokenizer
    assert tok.convert_tokens_to_ids(hf.image_token) == processor.image_token_id
    assert tok.convert_tokens_to_ids(hf.video_token) == processor.video_token_id
    assert tok.convert_tokens_to_ids(hf.vision_bos_token) == processor.vision_start_id
    assert tok.convert_tokens_to_ids(hf.vision_eos_token) == processor.vision_end_id
    audio = (hf.audio_bos_token, hf.audio_token, hf.audio_eos_token)
    assert tuple(tok.convert_tokens_to_ids(t) for t in audio) == processor.audio_ids
    extractor = WhisperFeatureExtractor.from_pretrained(out)
    assert extractor.feature_size == 128 and extractor.sampling_rate == 16_000
    weights = {p.name for p in Path(out).glob("*.safetensors")}
    assert weights == ({"model.safetensors"} if whole else set())


def test_a_push_names_every_thinker_tensor_as_the_whole_checkpoint(_cache):
    """The reference: the tiny whole checkpoint's own ``thinker.`` keys (HF's class of the whole saved them)."""
    from safetensors import safe_open

    family = families.get(FAMILY)
    model = family.load("hf_class").from_pretrained(ensure_checkpoint(family=FAMILY))
    with safe_open(ensure_checkpoint(family=FAMILY, whole=True) / "model.safetensors", "pt") as f:
        want = {k for k in f.keys() if k.startswith("thinker.")}
    assert {whole_name(model, family, n, p) for n, p in model.named_parameters()} == want
