"""The family's chat template: a :class:`Conversation` → token ids and labels.

Token layout, identical to the chat template shipped with the family's checkpoints (the
processor's family entry, :mod:`qwenkit.model.families.registry`, says which)::

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n{text}<|vision_start|><|image_pad|>×n<|vision_end|>{text}<|im_end|>\\n
    <|im_start|>assistant\\n{reply}<|im_end|>\\n

- the system turn: the conversation's, else ``data.system_prompt``, else the family's default
  (Qwen2.5-VL: "You are a helpful assistant."; Qwen3-VL: none, so no system turn);
- each ``<audio>`` placeholder becomes the family's audio span (``family.audio_tokens``:
  ``<|audio_bos|>`` / ``<|audio_start|>``, ``n`` pads, the end token), ``n`` being HF's count for the
  audio's mel frames (:func:`qwenkit.data.audio.token_counter`);
- with ``data.use_audio_in_video`` each ``<video>`` is heard too, as HF's Omni processors write it:
  ``<|vision_start|>`` + the audio start token + the video's pads and its audio track's pads interleaved by
  time (:func:`qwenkit.data.audio.video_span`) + the audio end token + ``<|vision_end|>``; the track's count
  comes from the same list as the ``<audio>`` counts, in placeholder order (:func:`qwenkit.data.audio.heard`);
- each ``<image>`` placeholder becomes one vision span with ``n = t*h*w / merge²`` pad tokens,
  ``(t, h, w)`` being that image's patch grid; each ``<video>`` the same with ``<|video_pad|>``
  (a video's ``t`` is its number of temporal patches). Families with ``video_timestamps``
  (Qwen3-VL) write one span per temporal patch instead, each after its time as text,
  ``<{seconds:.1f} seconds><|vision_start|><|video_pad|>×h*w/merge²<|vision_end|>``, the time
  being the mean of the patch's two sampled frame times (:attr:`qwenkit.data.video.VideoPlan.timestamps`),
  as HF's Qwen3VLProcessor writes it; that text is tokenized with the text around it;
- families with ``think_tags`` (Qwen3.5) open the replies after the last user turn with a thinking
  block, ``<think>\\n{reasoning}\\n</think>\\n\\n`` (:meth:`ChatTemplate._thinking`);
- tool rows (:mod:`qwenkit.data.tool_turns`) as the family's template writes ``tools=``, ``tool_calls`` and ``role:
  tool`` messages (:mod:`qwenkit.data.tool_calls`): the tools block in the system turn, each reply's calls after its
  text (learned with it), a run of responses one ``user`` turn of ``<tool_response>`` blocks (never learned; an
  ``<image>`` in a response is a vision span, as in a user turn), tokenized whole as HF tokenizes it;
- labels learn only the assistant replies and their ``<|im_end|>`` (the model must learn to
  stop); everything else, the ``\\n`` after ``<|im_end|>`` included, is ``IGNORE_INDEX``;
- text is tokenized piece by piece between special tokens, so a reply's tokens are the ones
  the model emits after ``<|im_start|>assistant\\n`` at inference.
"""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass

from qwenkit.data import audio, tool_calls
from qwenkit.data.conversation import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Conversation
from qwenkit.data.report import BadSample
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.processor import Processor

_PLACEHOLDERS = re.compile(f"({'|'.join(re.escape(p) for p in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER))})")


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    images_end: int  # tokens up to and including the last media span's end token (0 without media)
    truncated_from: int | None = None  # original length when data.truncate_text cut the tail


class ChatTemplate:
    """Encodes conversations in the processor's family's chat format; ``system_prompt`` is the
    system text of conversations without one (``None``: the family's default)."""

    def __init__(self, processor: Processor, system_prompt: str | None, audio_in_video: bool = False):
        self.processor, self.audio_in_video = processor, audio_in_video
        family = processor.family
        self.system_prompt = system_prompt if system_prompt is not None else family.default_system
        self.video_timestamps = family.video_timestamps
        self.think_tags = family.think_tags
        self.tool_style = family.tool_calls
        tok = processor.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            # the Rust tokenizer itself: the same ids, without the Python wrapper's per-call
            # overhead (~10x the encoding of a short text piece; a scan encodes millions)
            self._encode_text = lambda text: backend.encode(text, add_special_tokens=False).ids
        else:
            self._encode_text = functools.partial(tok.encode, add_special_tokens=False)
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.im_start = tok.convert_tokens_to_ids("<|im_start|>")
        self.newline = self._encode_text("\n")
        self.headers = {
            role: self._encode_text(f"<|im_start|>{role}\n") for role in ("system", "user", "assistant")
        }

    def encode(
        self,
        conv: Conversation,
        grids: list[tuple[int, int, int]],
        video_grids: list[tuple[int, int, int]] = (),
        video_times: list[tuple[float, ...]] = (),
        audio_tokens: list[int] = (),
        video_seconds: list[float] = (),
    ) -> Encoded:
        """Token ids and labels of ``conv``; ``grids[k]`` / ``video_grids[k]`` is the patch grid
        of image / video ``k``, ``video_times[k]`` the seconds of each of video ``k``'s temporal
        patches (read by families with ``video_timestamps``), ``audio_tokens[k]`` the placeholder count
        of the ``k``-th audio heard (:func:`qwenkit.data.audio.measure`), ``video_seconds[k]`` video ``k``'s
        seconds per temporal patch (read with ``audio_in_video``)."""
        ids: list[int] = []
        labels: list[int] = []
        images_end = 0

        def add(tokens: list[int], learn: bool = False) -> None:
            ids.extend(tokens)
            labels.extend(tokens if learn else [IGNORE_INDEX] * len(tokens))

        system = conv.system if conv.system is not None else self.system_prompt
        if conv.tools:
            system = tool_calls.system_text(self.tool_style, system, conv.tools)
        if system:
            add(self.headers["system"] + self._encode_text(system) + [self.im_end] + self.newline)
        heard = iter(audio_tokens)  # <audio> entries and (audio_in_video) video tracks share one order
        media = {
            IMAGE_PLACEHOLDER: (iter(grids), iter(()), self.processor.image_token_id),
            VIDEO_PLACEHOLDER: (iter(video_grids), iter(video_times), self.processor.video_token_id),
            AUDIO_PLACEHOLDER: (heard, iter(()), None),
        }
        seconds = iter(video_seconds)
        start, end = self.processor.vision_start_id, self.processor.vision_end_id
        last_user = max((k for k, (role, _) in enumerate(conv.turns) if role == "user"), default=-1)
        for k, (role, text) in enumerate(conv.turns):
            if role == "assistant":
                add(self.headers[role])
                prompt, text = self._thinking(text, after_last_user=k > last_user)
                answer = text.split("</think>")[-1].lstrip("\n") if self.think_tags else text
                calls = tool_calls.calls_text(self.tool_style, answer, conv.calls.get(k, []))
                add(self._encode_text(prompt))
                add(self._encode_text(text + calls) + [self.im_end], learn=True)
                add(self.newline)
                continue
            if role == "tool":  # a run of responses: one user turn of <tool_response> blocks, tokenized whole
                if k and conv.turns[k - 1][0] == "tool":
                    continue
                run = [t for _, t in itertools.takewhile(lambda turn: turn[0] == "tool", conv.turns[k:])]
                add([self.im_start])
                text = "user" + tool_calls.response_body(self.tool_style, run)
            else:
                add(self.headers[role])
            pending = ""  # text not yet tokenized: HF tokenizes everything between special tokens at once
            for piece in _PLACEHOLDERS.split(text):  # text, placeholder, text, ...
                if piece not in media:
                    pending += piece
                    continue
                grid_iter, times, pad = media[piece]
                grid = next(grid_iter)
                if pad is None:  # audio: the family's own span, as HF's Omni processors expand <audio>
                    a_start, a_pad, a_end = self.processor.audio_ids
                    add(self._encode_text(pending) + [a_start] + [a_pad] * grid + [a_end])
                    pending = ""
                elif pad == self.processor.video_token_id and self.audio_in_video:
                    add(self._encode_text(pending) + [start] + self._heard_video(grid, next(seconds), next(heard)) + [end])
                    pending = ""
                elif pad == self.processor.video_token_id and self.video_timestamps:
                    t, h, w = grid
                    for seconds in next(times):  # one span per temporal patch, after its time
                        add(self._encode_text(pending + f"<{seconds:.1f} seconds>") + [start])
                        add([pad] * self.processor.image_tokens((1, h, w)) + [end])
                        pending = ""
                else:
                    add(self._encode_text(pending) + [start] + [pad] * self.processor.image_tokens(grid) + [end])
                    pending = ""
                images_end = len(ids)
            add(self._encode_text(pending) + [self.im_end] + self.newline)
        return Encoded(ids, labels, images_end)

    def _heard_video(self, grid: tuple[int, int, int], second_per_grid: float, audio_tokens: int) -> list[int]:
        """A video heard with its audio track: the audio span around its interleaved video and audio pads."""
        a_start, a_pad, a_end = self.processor.audio_ids
        pads = {"V": self.processor.video_token_id, "A": a_pad}
        letters = audio.video_span(self.processor.family, grid, second_per_grid, audio_tokens, self.processor.merge_size)
        return [a_start] + [pads[c] for c in letters] + [a_end]

    def _thinking(self, reply: str, after_last_user: bool) -> tuple[str, str]:
        """``(unlearned prefix, learned reply)`` of an assistant turn, as the family's template writes it.

        Families with ``think_tags`` (Qwen3.5) open the replies after the last user turn with a
        thinking block: a reply's own ``<think>...</think>`` is its reasoning, learned with the
        answer; without one the template writes the block empty, which is what a prompt with
        ``enable_thinking=false`` holds, so it is not learned. Earlier replies keep their answer only.
        """
        if not self.think_tags:
            return "", reply
        reasoning = None
        if "</think>" in reply:
            reasoning = reply.split("</think>")[0].split("<think>")[-1].strip("\n")
            reply = reply.split("</think>")[-1].lstrip("\n")
        if not after_last_user:
            return "", reply
        if reasoning is None:
            return "<think>\n\n</think>\n\n", reply
        return "", f"<think>\n{reasoning}\n</think>\n\n{reply}"


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
