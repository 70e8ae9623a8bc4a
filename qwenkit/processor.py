"""Image-only Qwen2.5-VL processor: a tokenizer plus transformers' Qwen2-VL image processor.

``Qwen2_5_VLProcessor`` insists on a video processor, which imports torchvision (optional here,
see DESIGN.md). Training only needs the tokenizer and the image processor, so this class holds
those two and reads/writes the same files as an HF checkpoint directory: a real Qwen2.5-VL
checkpoint loads with :meth:`Processor.from_pretrained`, and so does the embedded tiny one.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

try:  # transformers 5.x: the PIL backend needs no torchvision
    from transformers import Qwen2VLImageProcessorPil as ImageProcessor
except ImportError:  # transformers 4.57: the "slow" processor is PIL/numpy based
    from transformers import Qwen2VLImageProcessor as ImageProcessor

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The Qwen2-VL chat template, as shipped with Qwen2-VL / Qwen2.5-VL checkpoints.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Processor:
    """Tokenizer + Qwen2-VL image processor, saved and loaded like an HF processor."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_processor: ImageProcessor):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        missing = [t for t in SPECIAL_TOKENS[1:6] if t not in tokenizer.get_vocab()]
        if missing:
            raise ValueError(f"tokenizer lacks Qwen2-VL special tokens {missing}")
        self.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
        self.vision_start_id = tokenizer.convert_tokens_to_ids("<|vision_start|>")
        self.vision_end_id = tokenizer.convert_tokens_to_ids("<|vision_end|>")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.convert_tokens_to_ids("<|endoftext|>")

    @property
    def merge_size(self) -> int:
        return self.image_processor.merge_size

    def image_tokens(self, image_grid_thw) -> int:
        """Number of ``<|image_pad|>`` tokens for one image: t*h*w / merge²."""
        t, h, w = (int(x) for x in image_grid_thw)
        return t * h * w // self.merge_size**2

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)

    @classmethod
    def from_pretrained(cls, path: str | Path, min_pixels: int | None = None, max_pixels: int | None = None) -> Processor:
        path = Path(path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        kwargs = {}
        if min_pixels is not None:
            kwargs["min_pixels"] = min_pixels
        if max_pixels is not None:
            kwargs["max_pixels"] = max_pixels
        image_processor = ImageProcessor.from_pretrained(path, local_files_only=True, **kwargs)
        if min_pixels is not None or max_pixels is not None:
            # 4.57 keeps both the attributes and `size`; keep them in agreement.
            image_processor.min_pixels = min_pixels or image_processor.min_pixels
            image_processor.max_pixels = max_pixels or image_processor.max_pixels
            image_processor.size = {"shortest_edge": image_processor.min_pixels, "longest_edge": image_processor.max_pixels}
        return cls(tokenizer, image_processor)
