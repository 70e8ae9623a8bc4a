"""The embedded default: tiny model, offline processor, synthetic dataset."""

import json

import torch

from qwenkit.model import tiny
from qwenkit.model.processor import SPECIAL_TOKENS, Processor, pixel_bounds


def test_processor_round_trips_through_save_and_load(tmp_path):
    proc = tiny.build_processor()
    proc.save_pretrained(tmp_path)
    loaded = Processor.from_pretrained(tmp_path)
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour? 红色 it's 42<|im_end|>\n"
    a = proc.tokenizer(text)["input_ids"]
    b = loaded.tokenizer(text)["input_ids"]
    assert a == b
    assert loaded.tokenizer.decode(b) == text
    for t in SPECIAL_TOKENS:  # each special token is one id, never split
        assert len(loaded.tokenizer(t)["input_ids"]) == 1
    assert pixel_bounds(loaded.image_processor) == pixel_bounds(proc.image_processor)
    narrowed = Processor.from_pretrained(tmp_path, min_pixels=28 * 28, max_pixels=56 * 56)
    assert pixel_bounds(narrowed.image_processor) == (28 * 28, 56 * 56)


def test_chat_template_is_qwen2vl():
    proc = tiny.build_processor()
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = proc.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_image_expands_to_grid_over_merge_squared(processor):
    from PIL import Image

    for w, h in [(112, 112), (56, 84), (140, 70)]:
        out = processor.image_processor(images=[Image.new("RGB", (w, h))], return_tensors="pt")
        t, gh, gw = out["image_grid_thw"][0].tolist()
        assert processor.image_tokens(out["image_grid_thw"][0]) == t * gh * gw // 4
        assert out["pixel_values"].shape[0] == t * gh * gw


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


def test_synthetic_dataset_layout(tmp_path):
    path = tiny.write_dataset(tmp_path, n=6, seed=1)
    rows = json.loads(path.read_text())
    assert len(rows) == 6
    for row in rows:
        assert [m["role"] for m in row["messages"]][:2] == ["user", "assistant"]
        assert row["messages"][0]["content"].count("<image>") == len(row["images"]) == 1
        assert (tmp_path / row["images"][0]).is_file()
    assert any(len(r["messages"]) == 4 for r in rows)  # multi-turn samples exist
