"""qwenkit.model.tiny.checkpoint: the embedded default: the tiny model's config and checkpoint (its synthetic data: test_tiny_data.py, its processor: test_processor.py)."""

import json

import torch
from conftest import EVERY_FAMILY

from qwenkit.model.families import registry as families
from qwenkit.model.families.entry import VLLM_CPU_HEAD_SIZES, text_config
from qwenkit.model.tiny import checkpoint as tiny


def test_tiny_config_is_the_real_architecture(tiny_path):
    cfg = json.loads((tiny_path / "config.json").read_text())
    vision = cfg["vision_config"]
    assert vision["depth"] == 2 and vision["fullatt_block_indexes"] == [1]  # one windowed, one full
    text = cfg.get("text_config", cfg)
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert sum(rope["mrope_section"]) == head_dim // 2


def test_forward_backward_gives_grad_on_every_trainable_param(make_model, batch_factory):
    model = make_model(chunk=False)
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 <= n <= 5_000_000
    out = model(**batch_factory())
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_checkpoint_is_seeded_and_reused(tmp_path):
    a = tiny.ensure_checkpoint(root=tmp_path / "a")
    b = tiny.ensure_checkpoint(root=tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert tiny.ensure_checkpoint(root=tmp_path / "a") == a


@EVERY_FAMILY
def test_every_tiny_family_has_head_dims_vllms_cpu_attention_runs(family, family_path):
    """Decoder and vision heads of 32 (issue 62: the old 16 failed inside vLLM's CPU attention), HF's and vLLM's
    head dim alike (Qwen2.5-VL's is hidden / heads; Qwen3's names it), mRoPE over half the rotated dims."""
    entry = families.get(family)
    text = text_config(entry, family_path)
    assert text["hidden_size"] // text["num_attention_heads"] == 32 or text["head_dim"] == 32
    assert text.get("head_dim", 32) in VLLM_CPU_HEAD_SIZES
    config = json.loads((family_path / "config.json").read_text())
    vision = config.get("vision_config") or config["thinker_config"]["vision_config"]
    assert vision["hidden_size"] // vision["num_heads"] == 32
    rope = text.get("rope_parameters") or text["rope_scaling"]
    assert sum(rope["mrope_section"]) == 32 * rope.get("partial_rotary_factor", 1.0) / 2


def test_the_moe_experts_are_written_in_qwens_published_layout_and_load_back_as_drawn(tmp_path):
    """Qwen3-VL-MoE's fused experts on disk as Qwen's checkpoints hold them (what vLLM and transformers 4.57 read:
    gate_up [E, hidden, 2·inter], down [E, inter, hidden]), and HF's class loads them back to the seeded draw."""
    from safetensors import safe_open
    from transformers import AutoConfig

    entry = families.get("qwen3_vl_moe")
    path = tiny.ensure_checkpoint(family="qwen3_vl_moe", root=tmp_path)
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
