"""A dataset row's prompt as a vLLM request that vLLM expands back into the kit's own prompt.

vLLM takes a prompt's token ids with each image or video as one placeholder, and the media as
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

import numpy as np
import torch

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
    start, end = processor.vision_start_id, processor.vision_end_id
    times = iter(video_times)
    out: list[int] = []
    k = 0
    while k < len(ids):
        t = ids[k]
        if t not in (image, video):
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


__all__ = ["check_prompts", "prompt_ids", "request", "video_item"]
