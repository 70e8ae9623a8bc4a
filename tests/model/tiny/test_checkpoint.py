"""qwenkit.model.tiny.checkpoint: the embedded default: the tiny model's config and checkpoint (its synthetic data: test_tiny_data.py, its processor: test_processor.py)."""

import json

import torch
from conftest import EVERY_FAMILY

from qwenkit.model.families import registry as families
from qwenkit.model.families.entry import text_config
from qwenkit.model.families.vllm_limits import VLLM_CPU_HEAD_SIZES
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

