"""A dataset row's prompt as a vLLM request that vLLM expands back into the kit's own prompt; the same request,
and vLLM's reply, as JSON for a server (``vllm.mode: server``: :func:`to_wire`, :func:`reply_to_wire`).

vLLM takes a prompt's token ids with each image, video or audio as one placeholder, and the media as
``multi_modal_data``; its processor expands each placeholder again (:func:`prompt_ids`):

- **images**: each run of ``<|image_pad|>`` collapsed to one; the image file as read, which vLLM's
  processor resizes into the run's pixel bounds (the engine's ``mm_processor_kwargs``) as the kit's does;
- **videos** (Qwen2.5-VL, Qwen3-VL): the frames the kit samples and resizes (:meth:`qwenkit.data.video.VideoProcessor.resized`,
  ``[n, h, w, 3]`` uint8), with their metadata (:func:`video_item`: the stream's ``fps``, the sampled
  ``frames_indices`` of ``total_num_frames``, ``do_sample_frames: False``). vLLM's video processor
  keeps frames already on the patch grid (the engine's ``videos_kwargs`` bound nothing; torchvision's
  resize returns a same-size frame as it is); Qwen2.5-VL's ``second_per_grid_ts`` is
  ``2 / sampled_fps``, ``sampled_fps = len(frames_indices) / total_num_frames · fps``, the kit's; Qwen3-VL's
  time text is the mean time of each temporal patch's first and last frame, the kit's. A Qwen2.5-VL
  video's pads collapse to one between its vision start and end; a Qwen3-VL video (``<t seconds>``
  before each temporal patch's vision span) becomes one bare ``<|video_pad|>``, which vLLM (with
  transformers >= 5.10) replaces by every patch's time text and span.
- **audio** (Qwen2.5-Omni): each ``<audio>``'s wave as the kit decodes it (:func:`qwenkit.data.audio.waves`: PyAV,
  float32 mono at 16 kHz; torchaudio is not needed), ``(wave, 16000)``, its run of audio pads collapsed to one
  between the audio start and end; vLLM extracts the features with the kit's extractor
  (:mod:`qwenkit.engine.generation.vllm_omni`) and expands the pad by HF's count. A row with
  ``data.use_audio_in_video`` is refused by name: the kit does not hand vLLM a video's audio track.

**Qwen2.5-VL videos' positions.** Its video is one vision span of ``t`` temporal patches; vLLM 0.32 starts the
text after it at the span's largest position + 1 (the temporal one included), transformers 5.x at the span's start
+ ``max(h, w)``, and the kit trains with transformers' positions: the engine replaces vLLM's rule by transformers'
(:mod:`qwenkit.engine.generation.vllm_patches`). Without it the same pixels (equal to 5e-7), grid and
``second_per_grid_ts`` gave vLLM log-probs 2.8e-4 (8.5e-4 on another row) away from the kit's on the tiny model;
with it they are equal (fp32; images and Qwen3-VL videos, whose temporal patches are separate spans of ``t = 1``:
5e-7).

vLLM tokenizes each time text alone; the kit's template tokenizes the first with the text before the
video, which can merge across the boundary (``"x:<0.5 seconds>"``): such a row is refused, naming it.
After generation :func:`check_prompts` compares vLLM's expanded prompt with the kit's, so a media
token count or a time text that differs stops the run instead of sampling from another prompt.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from qwenkit.data import audio
from qwenkit.data.images import load


def request(dataset, i: int) -> tuple[dict, dict[str, torch.Tensor], object]:
    """Row ``i``'s prompt as a vLLM request (module docstring), the kit's prompt inputs and its conversation.
    A video is decoded twice (the kit's pixels, vLLM's frames): a rollout's rows, not a training step's."""
    inputs, conv = dataset.prompt(i)
    processor = dataset.processor
    mm = {}
    refs = dataset.image_refs(i, conv)
    if refs:
        mm["image"] = [load(ref, conv.where) for ref in refs]
    videos = [video_item(dataset.video_processor, ref, meta, conv.where)
              for ref, meta in zip(dataset.video_refs(i, conv), dataset.index.videos(i))]  # fmt: skip
    if videos:
        mm["video"] = [(frames, metadata) for frames, metadata, _ in videos]
    if dataset.index.grids(i, "audio"):
        if dataset.data.use_audio_in_video:
            raise ValueError(f"{conv.where}: data.use_audio_in_video=true, and vLLM is not given a video's audio track "
                             "by the kit; set it false, or use the hf engine")  # fmt: skip
        base = dataset.sources[int(dataset.index.source[i])].base_dir
        mm["audio"] = [(wave, audio.SAMPLE_RATE) for wave in audio.waves(conv, base)]
    times = [plan.timestamps if processor.family.video_timestamps else () for *_, plan in videos]
    out = {"prompt_token_ids": prompt_ids(inputs["input_ids"][0].tolist(), processor, times, conv.where)}
    if mm:
        out["multi_modal_data"] = mm
    return out, inputs, conv


def video_item(video_processor, ref, meta, where) -> tuple[np.ndarray, dict, object]:
    """``(frames [n, h, w, 3] uint8, vLLM's video metadata, the kit's plan)`` of one of a row's videos."""
    frames, plan = video_processor.frames(ref, meta, where)
    h, w = plan.size
    metadata = {"fps": meta.fps, "frames_indices": list(plan.indices), "total_num_frames": meta.frames,
                "duration": meta.frames / meta.fps, "height": h, "width": w, "do_sample_frames": False}  # fmt: skip
    return video_processor.resized(frames, plan), metadata, plan


def prompt_ids(ids: list[int], processor, video_times: list[tuple[float, ...]], where) -> list[int]:
    """The kit's prompt ``ids`` with each image and video as the one placeholder vLLM expands (module
    docstring); ``video_times[k]``: video ``k``'s temporal-patch seconds, ``()`` where the family writes none."""
    image, video = processor.image_token_id, processor.video_token_id
    pads = (image, video, *processor.audio_ids[1:2])  # an Omni thinker's audio pads collapse as an image's
    start, end = processor.vision_start_id, processor.vision_end_id
    times = iter(video_times)
    out: list[int] = []
    k = 0
    while k < len(ids):
        t = ids[k]
        if t not in pads:
            out.append(t)
            k += 1
            continue
        seconds = next(times, ()) if t == video else ()
        if seconds:  # every temporal patch's "<s seconds>" <vision_start> pads <vision_end>: one bare pad
            first = processor.tokenizer.encode(f"<{seconds[0]:.1f} seconds>", add_special_tokens=False)
            if out[-len(first) - 1 :] != [*first, start]:
                raise ValueError(f"{where}: the text before its video runs into its first time text "
                                 f"('<{seconds[0]:.1f} seconds>') when tokenized, which vLLM tokenizes alone; "
                                 "put a newline before the <video> tag, or use the hf engine")  # fmt: skip
            del out[-len(first) - 1 :]
            for _ in seconds:
                k = ids.index(end, k) + 1
        else:  # a run of pads: one
            while k < len(ids) and ids[k] == t:
                k += 1
        out.append(t)
    return out


def check_prompts(outs: list, asked: list[tuple[dict, dict, object]]) -> None:
    """vLLM expanded each request (``outs[r]``, of ``asked[r]``) into the kit's own prompt; raises naming the
    row where it did not (another media token count or time text: the reply would answer another prompt)."""
    for out, (_, inputs, conv) in zip(outs, asked, strict=True):
        if list(out.prompt_token_ids) != inputs["input_ids"][0].tolist():
            raise RuntimeError(f"{conv.where}: vLLM expanded the prompt into {len(out.prompt_token_ids)} tokens, the "
                               f"kit's has {inputs['input_ids'].shape[1]} (its media resized or timed otherwise); "
                               "use the hf engine for this row")  # fmt: skip


# --- the same requests and replies over HTTP (vllm.mode: server; qwenkit.engine.generation.vllm_server) ---------
# A request keeps its token ids; each image travels as PNG (lossless: the server's pixels are the rank's), each video
# as its raw uint8 frames and its metadata, each audio as its raw float32 wave and rate; a reply carries what the kit reads of vLLM's ``RequestOutput``.


def to_wire(request: dict) -> dict:
    """A JSON-able copy of a vLLM request (:func:`request`: ``prompt_token_ids``, ``multi_modal_data``)."""
    mm = request.get("multi_modal_data", {})
    out = {"prompt_token_ids": [int(t) for t in request["prompt_token_ids"]]}
    if images := mm.get("image"):
        out["images"] = [_png(image) for image in images]
    if videos := mm.get("video"):
        out["videos"] = [{"frames": base64.b64encode(np.ascontiguousarray(f, np.uint8).tobytes()).decode(),
                          "shape": list(f.shape), "metadata": {k: _plain(v) for k, v in meta.items()}}
                         for f, meta in videos]  # fmt: skip
    if audios := mm.get("audio"):
        out["audios"] = [{"wave": base64.b64encode(np.ascontiguousarray(w, np.float32).tobytes()).decode(), "rate": rate}
                         for w, rate in audios]  # fmt: skip
    return out


def from_wire(payload: dict) -> dict:
    """The vLLM request :func:`to_wire` was given."""
    mm = {}
    if images := payload.get("images"):
        mm["image"] = [Image.open(io.BytesIO(base64.b64decode(b))) for b in images]
    if videos := payload.get("videos"):
        mm["video"] = [(np.frombuffer(base64.b64decode(v["frames"]), np.uint8).reshape(v["shape"]), v["metadata"])
                       for v in videos]  # fmt: skip
    if audios := payload.get("audios"):
        mm["audio"] = [(np.frombuffer(base64.b64decode(a["wave"]), np.float32), a["rate"]) for a in audios]
    out = {"prompt_token_ids": payload["prompt_token_ids"]}
    if mm:
        out["multi_modal_data"] = mm
    return out


def settings_from_wire(settings: dict) -> dict:
    """``SamplingParams``' keyword arguments as sent: JSON made ``logit_bias``' token ids strings."""
    if "logit_bias" in settings:
        settings = {**settings, "logit_bias": {int(t): float(b) for t, b in settings["logit_bias"].items()}}
    return settings


@dataclass
class Logprob:
    logprob: float  # the token's log-prob, as vLLM's ``Logprob``


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None  # per drawn token: {token: its log-prob} (``logprobs=0``: the drawn one)


@dataclass
class Reply:
    """What the kit reads of vLLM's ``RequestOutput``: the prompt it expanded, and its samples."""

    prompt_token_ids: list[int]
    outputs: list[Sample]


def reply_to_wire(out) -> dict:
    """A JSON-able copy of vLLM's ``RequestOutput`` (floats as Python's: a float32 log-prob arrives exact)."""
    samples = [{"token_ids": list(s.token_ids),
                "logprobs": None if s.logprobs is None else [[[t, p.logprob] for t, p in step.items()] for step in s.logprobs]}
               for s in out.outputs]  # fmt: skip
    return {"prompt_token_ids": list(out.prompt_token_ids), "outputs": samples}


def reply_from_wire(payload: dict) -> Reply:
    samples = [Sample(s["token_ids"], None if s["logprobs"] is None else
                      [{int(t): Logprob(p) for t, p in step} for step in s["logprobs"]])
               for s in payload["outputs"]]  # fmt: skip
    return Reply(payload["prompt_token_ids"], samples)


def _png(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _plain(value):
    """A video metadata value as JSON holds it (numpy's numbers as Python's)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


__all__ = ["Logprob", "Reply", "Sample", "check_prompts", "from_wire", "prompt_ids", "reply_from_wire", "reply_to_wire",
           "request", "settings_from_wire", "to_wire", "video_item"]  # fmt: skip
