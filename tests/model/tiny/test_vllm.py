"""qwenkit.model.tiny.vllm: the tiny families at vLLM's CPU shapes (head dim 32), otherwise the tiny default's."""

import json

import pytest
import torch

from qwenkit.model.families import registry as families
from qwenkit.model.processor import Processor
from qwenkit.model.tiny import checkpoint as tiny
from qwenkit.model.tiny import vllm as tiny_vllm


@pytest.mark.parametrize("family", tiny_vllm.FAMILIES)
def test_widened_checkpoint_has_head_dim_32_and_the_tiny_tokenizer(family):
    if problem := families.get(family).unavailable():
        pytest.skip(problem)
    path = tiny_vllm.ensure_checkpoint(family)
    assert tiny_vllm.ensure_checkpoint(family) == path  # written once
    config = json.loads((path / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert text["hidden_size"] // text["num_attention_heads"] == 32 and text.get("head_dim", 32) == 32
    assert vision["hidden_size"] // vision["num_heads"] == 32
    rope = text.get("rope_parameters") or text["rope_scaling"]
    assert sum(rope["mrope_section"]) == 32 * rope.get("partial_rotary_factor", 1.0) / 2  # half the rotated dims
    if "linear_key_head_dim" in text:  # Qwen3.5's Gated DeltaNet, as vLLM's CPU kernel takes it
        assert text["linear_key_head_dim"] == text["linear_value_head_dim"] == 128
    widened, default = Processor.from_pretrained(path), Processor.from_pretrained(tiny.ensure_checkpoint(family=family))
    assert widened.tokenizer.get_vocab() == default.tokenizer.get_vocab()
    model = families.get(family).load("hf_class").from_pretrained(path).eval()
    ids = widened.tokenizer("What colour is the circle?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape[-1] == model.config.get_text_config().vocab_size and torch.isfinite(logits).all()


def test_a_family_without_vllm_shapes_is_refused():
    with pytest.raises(ValueError, match="no vLLM-shaped tiny model of 'qwen2_5_omni'"):
        tiny_vllm.ensure_checkpoint("qwen2_5_omni")


def test_the_moe_experts_are_written_in_qwens_published_layout():
    """Qwen3-VL-MoE's fused experts on disk as Qwen's checkpoints hold them (what vLLM reads), and HF loads them back."""
    from safetensors import safe_open

    path = tiny_vllm.ensure_checkpoint("qwen3_vl_moe")
    text = json.loads((path / "config.json").read_text())["text_config"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        down = f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape()
        gate_up = f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
    inter, hidden = text["moe_intermediate_size"], text["hidden_size"]
    assert list(down)[1:] == [inter, hidden] and list(gate_up)[1:] == [hidden, 2 * inter]  # whatever transformers holds
