"""qwenkit.model.tiny.vllm: the tiny Qwen3.5s with linear-attention heads of 128 (vLLM's CPU Gated DeltaNet) and
Qwen3-VL-MoE's experts in Qwen's published layout, otherwise the tiny default's."""

import json

import pytest
import torch

from qwenkit.model.families import registry as families
from qwenkit.model.processor import Processor
from qwenkit.model.tiny import checkpoint as tiny
from qwenkit.model.tiny import vllm as tiny_vllm


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
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


def test_the_moe_experts_are_written_in_qwens_published_layout_and_load_back_as_drawn(tmp_path):
    """Qwen3-VL-MoE's fused experts on disk as Qwen's checkpoints hold them (what vLLM and transformers 4.57 read:
    gate_up [E, hidden, 2·inter], down [E, inter, hidden]), and HF's class loads them back to the seeded draw."""
    from safetensors import safe_open
    from transformers import AutoConfig

    entry = families.get("qwen3_vl_moe")
    path = tiny_vllm.ensure_checkpoint("qwen3_vl_moe", root=tmp_path)
    text = json.loads((path / "config.json").read_text())["text_config"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        down = f.get_slice("model.language_model.layers.0.mlp.experts.down_proj").get_shape()
        gate_up = f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
    inter, hidden = text["moe_intermediate_size"], text["hidden_size"]
    assert list(down)[1:] == [inter, hidden] and list(gate_up)[1:] == [hidden, 2 * inter]
    assert hidden != 2 * inter  # else 5.x's load cannot tell the layouts apart (same shape: not transposed)
    loaded = entry.load("hf_class").from_pretrained(path).state_dict()
    torch.manual_seed(0)  # the writer's seed
    drawn = entry.load("hf_class")(AutoConfig.from_pretrained(path)).state_dict()
    assert loaded.keys() == drawn.keys()
    for name, tensor in drawn.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
