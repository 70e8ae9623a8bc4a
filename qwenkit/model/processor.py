"""Image-only Qwen-VL processor: a tokenizer plus transformers' Qwen2-VL image processor (Qwen3-VL's too).

``Qwen2_5_VLProcessor`` insists on a video processor, which imports torchvision: optional here,
because a torchvision wheel built for another device (PyPI's is CUDA-linked) fails to import on
a CPU-only machine and then breaks transformers' imports with it. Training only needs the
tokenizer and the image processor, so this class holds those two and reads/writes the same files
as an HF checkpoint directory: a real Qwen2.5-VL checkpoint loads with
:meth:`Processor.from_pretrained`, and so does the embedded tiny one.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from qwenkit.model.families import registry as families
from qwenkit.model.families.entry import Family

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

# The Qwen3-VL (Instruct) chat template, as shipped with Qwen3-VL checkpoints, without its tool-call
# branches (qwenkit trains user/assistant turns): no default system turn, and assistant content parts
# are text only.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}"
    "{%- else %}{%- for content in messages[0].content %}{%- if 'text' in content %}{{- content.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for content_item in message.content %}"
    "{%- if 'text' in content_item %}{{- content_item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# The Qwen3.5 chat template: Qwen3-VL's, plus the thinking block Qwen3.5 checkpoints write (without the
# tool-call branches, as above). Assistant turns after the last user turn open with
# "<think>\n{reasoning}\n</think>\n\n" (empty reasoning: "<think>\n\n</think>\n\n"); earlier ones keep
# their answer only. A reply's own "<think>...</think>" is its reasoning. The generation prompt opens
# the thinking block ("<think>\n"), or writes it empty with enable_thinking=false.
QWEN3_5_CHAT_TEMPLATE = (
    QWEN3_VL_CHAT_TEMPLATE.split("{%- set image_count")[0]
    + "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    + QWEN3_VL_CHAT_TEMPLATE[QWEN3_VL_CHAT_TEMPLATE.index("{%- set image_count") : QWEN3_VL_CHAT_TEMPLATE.index(
        "{%- elif message.role == 'assistant' %}")]
    + "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- set text = namespace(value='') %}{%- if message.content is string %}{%- set text.value = message.content %}"
    "{%- else %}{%- for content_item in message.content %}{%- if 'text' in content_item %}"
    "{%- set text.value = text.value + content_item.text %}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- set content = text.value %}"
    "{%- set reasoning = '' %}{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query %}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
THINK_TOKENS = ("<think>", "</think>")  # added (not special) tokens of Qwen3.5's vocabulary


def pixel_bounds(image_processor) -> tuple[int, int]:
    """(min_pixels, max_pixels) the image processor resizes into."""
    size = image_processor.size
    get = size.get if isinstance(size, dict) else (lambda k: getattr(size, k, None))
    return int(get("shortest_edge")), int(get("longest_edge"))


class Processor:
    """Tokenizer + Qwen2-VL image processor, saved and loaded like an HF processor.

    ``family`` is the registry entry (:mod:`qwenkit.model.families.registry`) of the model family whose
    checkpoint the files come from, resolved once (:mod:`qwenkit.model.families.spec`): it says how
    conversations are templated and videos sampled, so everything the data pipeline builds from
    this processor follows the family."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, image_processor: ImageProcessor,
                 family: Family = families.FAMILIES[families.TINY_DEFAULT]):  # fmt: skip
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.family = family
        missing = [t for t in SPECIAL_TOKENS[1:6] if t not in tokenizer.get_vocab()]
        if missing:
            raise ValueError(f"tokenizer lacks Qwen2-VL special tokens {missing}")
        self.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
        self.vision_start_id = tokenizer.convert_tokens_to_ids("<|vision_start|>")
        self.vision_end_id = tokenizer.convert_tokens_to_ids("<|vision_end|>")
        # (start, pad, end) of an audio span, from the family's entry; () for a family without an audio tower
        self.audio_ids = tuple(tokenizer.convert_tokens_to_ids(t) for t in family.audio_tokens)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.convert_tokens_to_ids("<|endoftext|>")

    @property
    def merge_size(self) -> int:
        return self.image_processor.merge_size

    def image_tokens(self, image_grid_thw) -> int:
        """Number of ``<|image_pad|>`` (or ``<|video_pad|>``) tokens for one image (video): t*h*w / merge²."""
        t, h, w = (int(x) for x in image_grid_thw)
        return t * h * w // self.merge_size**2

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, min_pixels: int | None = None, max_pixels: int | None = None,
        family: Family | None = None,
    ) -> Processor:
        """``family``: the model family's entry (default: ``path``'s, :func:`qwenkit.model.families.registry.of_directory`)."""
        path = Path(path)
        if family is None:
            family = families.of_directory(path)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        kwargs = {}
        if min_pixels is not None or max_pixels is not None:
            # `size` is the one spelling both 4.57 and 5.x read (5.x dropped min_/max_pixels)
            saved = ImageProcessor.from_pretrained(path, local_files_only=True)
            lo, hi = pixel_bounds(saved)
            kwargs["size"] = {"shortest_edge": min_pixels or lo, "longest_edge": max_pixels or hi}
            if hasattr(saved, "min_pixels"):  # 4.57 saves min_/max_pixels, which override `size`
                kwargs.update(min_pixels=min_pixels or lo, max_pixels=max_pixels or hi)
        image_processor = ImageProcessor.from_pretrained(path, local_files_only=True, **kwargs)
        if hasattr(image_processor, "min_pixels"):  # 4.57 resizes by the attributes: make `size` agree
            image_processor.size = {"shortest_edge": image_processor.min_pixels, "longest_edge": image_processor.max_pixels}
        return cls(tokenizer, image_processor, family)


@functools.cache
def needs_mm_token_type_ids() -> bool:
    """Whether samples carry ``mm_token_type_ids``: transformers 5.x builds 3-D mRoPE positions
    only when it is passed; 4.57 has no such argument (it finds image tokens in ``input_ids``).

    The modeling module is imported here, on first use, so that the launcher and the data checks
    (which import this module) do not load transformers' model code."""
    from transformers import Qwen2_5_VLModel

    return "mm_token_type_ids" in inspect.signature(Qwen2_5_VLModel.forward).parameters
