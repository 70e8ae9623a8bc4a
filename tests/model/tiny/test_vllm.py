"""qwenkit.model.tiny.vllm: the tiny Qwen3.5s with linear-attention heads of 128 (vLLM's CPU Gated DeltaNet),
otherwise the tiny default's."""

import json

import pytest
import torch

from qwenkit.model.families import registry as families
from qwenkit.model.processor import Processor
from qwenkit.model.tiny import checkpoint as tiny
from qwenkit.model.tiny import vllm as tiny_vllm


@pytest.mark.parametrize("family", tiny_vllm.FAMILIES)
def test_widened_checkpoint_has_linear_heads_of_128_and_the_tiny_tokenizer(family):
    if problem := families.get(family).unavailable():
        pytest.skip(problem)
    path = tiny_vllm.ensure_checkpoint(family)
    assert tiny_vllm.ensure_checkpoint(family) == path  # written once
    text = json.loads((path / "config.json").read_text())["text_config"]
    default = json.loads((tiny.ensure_checkpoint(family=family) / "config.json").read_text())["text_config"]
    assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == 128
    widened = {k: v for k, v in text.items() if k not in ("linear_key_head_dim", "linear_value_head_dim")}
    assert widened == {k: v for k, v in default.items() if k not in ("linear_key_head_dim", "linear_value_head_dim")}
    processor = Processor.from_pretrained(path)
    assert processor.tokenizer.get_vocab() == Processor.from_pretrained(tiny.ensure_checkpoint(family=family)).tokenizer.get_vocab()
    model = families.get(family).load("hf_class").from_pretrained(path).eval()
    ids = processor.tokenizer("What colour is the circle?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape[-1] == model.config.get_text_config().vocab_size and torch.isfinite(logits).all()


def test_a_family_vllm_runs_as_it_is_has_no_widened_copy():
    with pytest.raises(ValueError, match="no vLLM-widened tiny model of 'qwen2_5_vl'.*run on vLLM as they are"):
        tiny_vllm.ensure_checkpoint("qwen2_5_vl")
