"""qwenkit.model.processor: the offline processor round-trips through save and load (every special token
one id), its chat template is Qwen2-VL's, and an image expands to grid / merge² tokens as the image processor grids it."""

from qwenkit.model.processor import SPECIAL_TOKENS, Processor, pixel_bounds
from qwenkit.model.tiny import checkpoint as tiny


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
