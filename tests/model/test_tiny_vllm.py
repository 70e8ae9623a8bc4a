"""qwenkit.model.tiny_vllm: the tiny families at vLLM's CPU shapes (head dim 32), otherwise the tiny default's."""

import json

import pytest
import torch

from qwenkit.model import family as families
from qwenkit.model import tiny, tiny_vllm
from qwenkit.model.processor import Processor


@pytest.mark.parametrize("family", tiny_vllm.FAMILIES)
def test_widened_checkpoint_has_head_dim_32_and_the_tiny_tokenizer(family):
    path = tiny_vllm.ensure_checkpoint(family)
    assert tiny_vllm.ensure_checkpoint(family) == path  # written once
    config = json.loads((path / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert text["hidden_size"] // text["num_attention_heads"] == 32 and text.get("head_dim", 32) == 32
    assert vision["hidden_size"] // vision["num_heads"] == 32
    rope = text.get("rope_parameters") or text["rope_scaling"]
    assert sum(rope["mrope_section"]) == 16
    widened, default = Processor.from_pretrained(path), Processor.from_pretrained(tiny.ensure_checkpoint(family=family))
    assert widened.tokenizer.get_vocab() == default.tokenizer.get_vocab()
    model = families.get(family).load("hf_class").from_pretrained(path).eval()
    ids = widened.tokenizer("What colour is the circle?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape[-1] == model.config.get_text_config().vocab_size and torch.isfinite(logits).all()


def test_a_family_without_vllm_shapes_is_refused():
    with pytest.raises(ValueError, match="no vLLM-shaped tiny model of 'qwen3_5'"):
        tiny_vllm.ensure_checkpoint("qwen3_5")
