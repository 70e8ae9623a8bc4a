"""The ``qwen2vl`` chat template: a :class:`Conversation` → token ids and labels.

Token layout, identical to the chat template shipped with Qwen2-VL / Qwen2.5-VL checkpoints::

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n{text}<|vision_start|><|image_pad|>×n<|vision_end|>{text}<|im_end|>\\n
    <|im_start|>assistant\\n{reply}<|im_end|>\\n

- each ``<image>`` placeholder becomes one vision span with ``n = t*h*w / merge²`` pad tokens,
  ``(t, h, w)`` being that image's patch grid; each ``<video>`` the same with ``<|video_pad|>``
  (a video's ``t`` is its number of temporal patches);
- labels learn only the assistant replies and their ``<|im_end|>`` (the model must learn to
  stop); everything else, the ``\\n`` after ``<|im_end|>`` included, is ``IGNORE_INDEX``;
- text is tokenized piece by piece between special tokens, so a reply's tokens are the ones
  the model emits after ``<|im_start|>assistant\\n`` at inference.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from qwenkit.data.conversation import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Conversation
from qwenkit.data.report import BadSample
from qwenkit.model.loss import IGNORE_INDEX
from qwenkit.model.processor import Processor

_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    images_end: int  # tokens up to and including the last <|vision_end|> (0 without images or videos)
    truncated_from: int | None = None  # original length when data.truncate_text cut the tail


class Qwen2VLTemplate:
    """Encodes conversations in the Qwen2-VL chat format; ``system_prompt`` is the default system text."""

    def __init__(self, processor: Processor, system_prompt: str):
        self.processor = processor
        self.system_prompt = system_prompt
        tok = processor.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            # the Rust tokenizer itself: the same ids, without the Python wrapper's per-call
            # overhead (~10x the encoding of a short text piece; a scan encodes millions)
            self._encode_text = lambda text: backend.encode(text, add_special_tokens=False).ids
        else:
            self._encode_text = functools.partial(tok.encode, add_special_tokens=False)
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.newline = self._encode_text("\n")
        self.headers = {
            role: self._encode_text(f"<|im_start|>{role}\n") for role in ("system", "user", "assistant")
        }

    def encode(
        self,
        conv: Conversation,
        grids: list[tuple[int, int, int]],
        video_grids: list[tuple[int, int, int]] = (),
    ) -> Encoded:
        """Token ids and labels of ``conv``; ``grids[k]`` / ``video_grids[k]`` is the patch grid
        of image / video ``k``."""
        ids: list[int] = []
        labels: list[int] = []
        images_end = 0

        def add(tokens: list[int], learn: bool = False) -> None:
            ids.extend(tokens)
            labels.extend(tokens if learn else [IGNORE_INDEX] * len(tokens))

        system = conv.system if conv.system is not None else self.system_prompt
        if system:
            add(self.headers["system"] + self._encode_text(system) + [self.im_end] + self.newline)
        pads = {
            IMAGE_PLACEHOLDER: (iter(grids), self.processor.image_token_id),
            VIDEO_PLACEHOLDER: (iter(video_grids), self.processor.video_token_id),
        }
        for role, text in conv.turns:
            add(self.headers[role])
            if role == "assistant":
                add(self._encode_text(text) + [self.im_end], learn=True)
                add(self.newline)
                continue
            for piece in _PLACEHOLDERS.split(text):  # text, placeholder, text, ...
                if piece not in pads:
                    add(self._encode_text(piece))
                    continue
                grid_iter, pad = pads[piece]
                n = self.processor.image_tokens(next(grid_iter))
                add([self.processor.vision_start_id] + [pad] * n + [self.processor.vision_end_id])
                images_end = len(ids)
            add([self.im_end] + self.newline)
        return Encoded(ids, labels, images_end)


def fit_length(enc: Encoded, conv: Conversation, max_length: int, truncate_text: bool) -> Encoded:
    """Apply ``data.max_length``: keep, cut text after the last image, or raise ``too_long``.

    An image or video span is never cut: the vision tower would produce more features than
    there are pad tokens. A sample whose kept part learns nothing is dropped too.
    """
    n = len(enc.input_ids)
    if n <= max_length:
        return enc
    if not truncate_text:
        raise BadSample(
            conv.where,
            "too_long",
            f"{n} tokens > data.max_length={max_length} (data.truncate_text=true cuts text after the last image)",
        )
    if enc.images_end > max_length:
        raise BadSample(
            conv.where,
            "too_long",
            f"{n} tokens > data.max_length={max_length} and the last image ends at token {enc.images_end}; "
            "an image is never truncated",
        )
    labels = enc.labels[:max_length]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        raise BadSample(
            conv.where,
            "too_long",
            f"{n} tokens > data.max_length={max_length} and no reply token is left after truncation",
        )
    return Encoded(enc.input_ids[:max_length], labels, enc.images_end, truncated_from=n)
