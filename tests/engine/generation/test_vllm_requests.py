"""qwenkit.engine.generation.vllm_requests without vLLM: a row's prompt with each image and video as one
placeholder expands, by vLLM's rule, back into the kit's own prompt; a Qwen3-VL video whose first time text
the template tokenized otherwise than alone is refused, naming the row. The mRoPE positions the engine gives vLLM's
Qwen2.5-VL (:func:`qwenkit.engine.generation.vllm_patches.trainer_mrope_positions`) are transformers' own
``get_rope_index`` of the kit's prompt, and its decode offset places a completion as the trainer's forward does."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_processor
from videos import write_video

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.engine.generation import vllm_requests as wire
from qwenkit.engine.generation.vllm_patches import trainer_mrope_positions
from qwenkit.engine.generation.vllm_requests import prompt_ids, request


def _dataset(root, family):
    """A row with an image and a video."""
    from PIL import Image

    Image.new("RGB", (80, 56), (30, 90, 200)).save(root / "blue.png")
    write_video(root / "clip.avi", 64, 48, 8, 4)
    rows = [{"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "A square."}],
             "videos": ["clip.avi"], "images": ["blue.png"]} for text in ["<image>and<video>What moves?"]]  # fmt: skip
    (root / "rows.json").write_text(json.dumps(rows))
    cfg = qconfig.load(overrides=["data.max_length=2048"])
    return data.read_checked(cfg.data, tiny_processor(family), str(root / "rows.json"))[0]


def _expand(ids, processor, video_times):
    """vLLM's expansion (transformers >= 5.10's Qwen3-VL processor): each image pad its grid's pads, each bare
    video pad every temporal patch's ``<t seconds>`` (tokenized alone), vision start, pads, vision end."""
    image_pads, video_pads = iter(processor.expanded_images), iter(video_times)
    out = []
    for t in ids:
        if t == processor.image_token_id:
            out += [t] * next(image_pads)
        elif t == processor.video_token_id:
            times, pads = next(video_pads)
            for seconds in times:
                out += processor.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
                out += [processor.vision_start_id, t] + [t] * (pads - 1) + [processor.vision_end_id]
        else:
            out.append(t)
    return out


def test_a_qwen3_vl_prompt_expands_back_into_the_kits_and_a_time_text_tokenized_otherwise_is_refused(tmp_path):
    dataset = _dataset(tmp_path, "qwen3_vl")
    processor = dataset.processor
    asked, inputs, conv = request(dataset, 0)
    ids = inputs["input_ids"][0].tolist()
    frames, metadata = asked["multi_modal_data"]["video"][0]
    (plan,) = [dataset.video_processor.plan(m, conv.where, "clip") for m in dataset.index.videos(0)]
    assert frames.shape == (len(plan.indices), *plan.size, 3) and metadata["frames_indices"] == list(plan.indices)
    assert len(asked["multi_modal_data"]["image"]) == 1
    image_pads = ids.count(processor.image_token_id)
    video_pads = ids.count(processor.video_token_id) // len(plan.timestamps)
    processor.expanded_images = [image_pads]
    assert asked["prompt_token_ids"].count(processor.video_token_id) == 1
    assert _expand(asked["prompt_token_ids"], processor, [(plan.timestamps, video_pads)]) == ids
    # the first time text tokenized into the text before it (a real vocabulary's " <" token): not what vLLM writes
    first = ids.index(processor.vision_start_id, ids.index(processor.image_token_id) + image_pads)  # the video's
    at = first - len(processor.tokenizer.encode(f"<{plan.timestamps[0]:.1f} seconds>", add_special_tokens=False))
    merged = ids[:at] + [ids[at] + 1] + ids[at + 1 :]  # its first token another
    with pytest.raises(ValueError, match=r"row 0: the text before its video runs into its first time text"):
        prompt_ids(merged, processor, [plan.timestamps], conv.where)


def test_a_qwen2_5_vl_prompt_expands_back_into_the_kits(tmp_path):
    dataset = _dataset(tmp_path, "qwen2_5_vl")
    processor = dataset.processor
    asked, inputs, _ = request(dataset, 0)
    ids, sent = inputs["input_ids"][0].tolist(), asked["prompt_token_ids"]
    assert sent.count(processor.image_token_id) == sent.count(processor.video_token_id) == 1
    expanded = []
    for t in sent:  # each placeholder its run of pads, as vLLM's processor expands it
        expanded += [t] * (ids.count(t) if t in (processor.image_token_id, processor.video_token_id) else 1)
    assert expanded == ids


class _Grids:
    """What vLLM's Qwen2.5-VL gives :func:`trainer_mrope_positions` (``iter_mm_grid_thw``): each vision span's
    offset, merged grid and time step, here read off the kit's prompt inputs."""

    def __init__(self, inputs, processor, config):
        ids = inputs["input_ids"][0].tolist()
        merge, rate = config.vision_config.spatial_merge_size, config.vision_config.tokens_per_second
        seconds = iter(inputs["second_per_grid_ts"].tolist())
        grids = {processor.image_token_id: iter(inputs["image_grid_thw"].tolist()),
                 processor.video_token_id: iter(inputs["video_grid_thw"].tolist())}  # fmt: skip
        self.spans = []
        for k, t in enumerate(ids):
            if t in grids and ids[k - 1] != t:
                gt, gh, gw = next(grids[t])
                step = next(seconds) * rate if t == processor.video_token_id else 1.0
                self.spans.append((k, gt, gh // merge, gw // merge, step))

    def iter_mm_grid_thw(self, mm_features):
        return iter(self.spans)


def test_the_positions_given_vllms_qwen2_5_vl_are_transformers_and_the_trainers(tmp_path):
    """The image-and-video row: the prompt's positions are the HF model's ``get_rope_index`` (transformers 5.x:
    the text after the video at its start + max(h, w), not after its last temporal position), and the decode
    offset continues them as ``get_rope_index`` of prompt + completion places the completion (the trainer's)."""
    import torch

    from qwenkit.model.families import registry as families
    from qwenkit.model.tiny.checkpoint import ensure_checkpoint

    dataset = _dataset(tmp_path, "qwen2_5_vl")
    inputs, _ = dataset.prompt(0)
    path = ensure_checkpoint(family="qwen2_5_vl")
    model = families.of_directory(path).load("hf_class").from_pretrained(path, dtype=torch.float32).model
    grids = _Grids(inputs, dataset.processor, model.config)
    assert any(t > 1 for _, t, *_ in grids.spans)  # a video of several temporal patches: where the two rules differ
    ids = inputs["input_ids"][0].tolist()
    got, delta = trainer_mrope_positions(grids, ids, [])
    completion = torch.tensor([[11, 12, 13]])
    full = torch.cat([inputs["input_ids"], completion], 1)
    kwargs = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts")}
    types = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, completion.shape[1]))
    want, _ = model.get_rope_index(full, mm_token_type_ids=types, **kwargs)  # [3, 1, S + 3]
    assert torch.equal(got, want[:, 0, : len(ids)])
    assert torch.equal(want[:, 0, len(ids) :], (torch.arange(len(ids), full.shape[1]) + delta).expand(3, -1))


def test_a_request_and_a_reply_cross_the_wire_unchanged(tmp_path):
    """Server mode's wire (JSON): a Qwen3-VL row's request (an image, a video's frames and metadata) arrives with
    the same ids, pixels, frames and metadata; a ``logit_bias``' token ids come back as ints; a reply's float32
    log-probs arrive exact."""
    dataset = _dataset(tmp_path, "qwen3_vl")
    asked, _, _ = request(dataset, 0)
    back = wire.from_wire(json.loads(json.dumps(wire.to_wire(asked))))
    assert back["prompt_token_ids"] == asked["prompt_token_ids"]
    (image,), (got_image,) = asked["multi_modal_data"]["image"], back["multi_modal_data"]["image"]
    assert got_image.mode == image.mode and np.array_equal(np.asarray(got_image), np.asarray(image))
    ((frames, meta),), ((got_frames, got_meta),) = asked["multi_modal_data"]["video"], back["multi_modal_data"]["video"]
    assert np.array_equal(got_frames, frames) and got_frames.dtype == np.uint8 and got_meta == json.loads(json.dumps(meta))
    settings = json.loads(json.dumps({"seed": 3, "logit_bias": {7: -100.0}}))
    assert wire.settings_from_wire(settings) == {"seed": 3, "logit_bias": {7: -100.0}}
    lp = float(np.float32(-6.0123456))  # a float32 log-prob, as vLLM's
    out = type("Out", (), {"prompt_token_ids": [1, 2], "outputs": [type("S", (), {"token_ids": [5, 9],
               "logprobs": [{5: wire.Logprob(lp)}, {9: wire.Logprob(-0.5), 4: wire.Logprob(-1.5)}]})()]})()  # fmt: skip
    reply = wire.reply_from_wire(json.loads(json.dumps(wire.reply_to_wire(out))))
    assert reply.prompt_token_ids == [1, 2] and reply.outputs[0].token_ids == [5, 9]
    assert reply.outputs[0].logprobs[0][5].logprob == lp and reply.outputs[0].logprobs[1][4].logprob == -1.5


def test_an_omni_rows_audio_goes_as_its_wave_with_one_pad_and_crosses_the_wire(tmp_path):
    """Qwen2.5-Omni: a row's audio is the kit's decoded 16 kHz wave in ``multi_modal_data``, its pads one between
    audio start and end (vLLM expands it by HF's count: the kit's prompt again), the wave exact over the wire; with
    ``data.use_audio_in_video`` the row is refused by name (vLLM gets no video's track from the kit)."""
    from data.test_audio import write_tone

    from qwenkit.data import audio

    write_tone(tmp_path / "a.wav")
    rows = [{"messages": [{"role": "user", "content": "<audio>What do you hear?"}, {"role": "assistant", "content": "A tone."}],
             "audios": ["a.wav"]}]  # fmt: skip
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    processor = tiny_processor("qwen2_5_omni")
    cfg = qconfig.load(overrides=["data.max_length=2048", "model.name=qwen2_5_omni"])
    dataset = data.read_checked(cfg.data, processor, str(tmp_path / "rows.json"))[0]
    asked, inputs, _ = request(dataset, 0)
    ((wave, rate),) = asked["multi_modal_data"]["audio"]
    assert rate == 16_000 and np.array_equal(wave, audio.decode("a.wav", None, tmp_path))
    start, pad, end = processor.audio_ids
    kit = inputs["input_ids"][0].tolist()
    ids = asked["prompt_token_ids"]
    k = ids.index(pad)
    assert ids[k - 1 : k + 2] == [start, pad, end] and ids.count(pad) == 1
    assert ids[:k] + [pad] * kit.count(pad) + ids[k + 1 :] == kit
    back = wire.from_wire(json.loads(json.dumps(wire.to_wire(asked))))
    ((got, got_rate),) = back["multi_modal_data"]["audio"]
    assert got_rate == rate and got.dtype == np.float32 and np.array_equal(got, wave)
    dataset.data.use_audio_in_video = True
    with pytest.raises(ValueError, match=r"data.use_audio_in_video=true, .*use the hf engine$"):
        request(dataset, 0)
