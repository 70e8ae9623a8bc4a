"""Qwen3-VL data against transformers' own Qwen3-VL code, on the tiny Qwen3-VL checkpoint's processor.

- tokens: the checkpoint's chat template through HF's ``apply_chat_template`` (no default system
  turn, images, several images, a system turn), each pad expanded as the processor expands it;
- video: frames sampled by HF's ``Qwen3VLVideoProcessor.sample_frames``, the grid from its
  ``smart_resize`` (and, on 5.x, ``get_num_of_video_patches`` with the per-frame cap), the
  ``<t seconds>`` text from ``Qwen3VLProcessor`` (5.x: its ``replace_video_token``), the patches
  from its ``patchify`` (5.x); HF's resize itself needs torchvision, so the clip here is already
  on the 32-px grid (both resizes are then the identity);
- labels: only the assistant replies and their ``<|im_end|>``;
- the prepared index is keyed by the family: a Qwen2.5-VL index is never read for Qwen3-VL.
"""

from __future__ import annotations

import importlib
import json
import types

import numpy as np
import pytest
import torch
from conftest import hf_reference_ids, make_cfg, runs, tiny_checkpoint, tiny_processor
from PIL import Image
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.video_utils import VideoMetadata

from qwenkit.data import read_dataset
from qwenkit.data.video import RULES
from qwenkit.model.families import registry as families
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.processor import Processor, needs_mm_token_type_ids

QWEN3 = "qwen3_vl"
# the module itself: through the package, transformers hands out a torchvision-requiring placeholder
hf_video = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")


@pytest.fixture(scope="module")
def processor(_cache):
    return tiny_processor(QWEN3)


def _image(path, w, h, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    return path.name


def _row(user, reply="A red square.", system=None, **media):
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user},
        {"role": "assistant", "content": reply},
    ]
    return {"messages": messages, **media}


def _assert_assistant_only(sample, row, tok):
    ids, labels = sample["input_ids"], sample["labels"]
    learned = [tok.decode(labels[s:e]) for s, e in runs(labels != IGNORE_INDEX)]
    assert learned == [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
    assert torch.equal(labels[labels != IGNORE_INDEX], ids[labels != IGNORE_INDEX])


def test_every_family_names_its_template_and_video_rule():
    for family in families.FAMILIES.values():
        assert isinstance(family.load("chat_template"), str) and family.video_rule in RULES


def test_template_equals_hf_chat_template(tmp_path, processor):
    """No default system turn (Qwen3-VL's template writes none), one image, two images in one turn
    around text, a multi-turn row, a row with its own system turn."""
    names = [_image(tmp_path / f"{k}.png", w, h, k) for k, (w, h) in enumerate([(64, 64), (96, 40), (40, 120)])]
    rows = [
        _row("What is this?"),
        _row("<image>What colour?", images=names[:1]),
        _row("Compare <image> with <image>: same?", "No.", images=names[1:]),
        {
            "messages": [
                {"role": "user", "content": "<image>Shape?"},
                {"role": "assistant", "content": "Circle."},
                {"role": "user", "content": "Colour?"},
                {"role": "assistant", "content": "Blue."},
            ],
            "images": names[:1],
        },
        _row("<image>Count?", "Two.", system="Answer in one word.", images=names[2:]),
    ]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    dataset, report = read_dataset(make_cfg(path=str(tmp_path / "d.json"), shuffle=False).data, processor)
    assert (len(dataset), report.skipped) == (len(rows), 0)
    for i, row in enumerate(rows):
        sample = dataset[i]
        assert sample["input_ids"].tolist() == hf_reference_ids(processor, row, dataset.samples[i].grids), i
        _assert_assistant_only(sample, row, processor.tokenizer)
    assert processor.tokenizer.decode(dataset[0]["input_ids"][:3]).startswith("<|im_start|>user")
    # data.system_prompt still applies to rows without a system turn
    prompted, _ = read_dataset(make_cfg(path=str(tmp_path / "d.json"), system_prompt="Be brief.").data, processor)
    with_system = _row("What is this?", system="Be brief.")
    assert prompted[0]["input_ids"].tolist() == hf_reference_ids(processor, with_system, [])


# ---------------------------------------------------------------------------------------------
# Video: 35 frames at 10 fps, sampled at 2 fps -> 7 frames (odd: the last temporal patch repeats one)

FRAMES, FPS, SIZE = 35, 10, (96, 64)  # width, height: on the 32-px grid, under the per-frame cap


def _hf_video_reference(d, ip):
    """``(indices, grid, timestamps, placeholder text, patches or None)`` from transformers' Qwen3-VL code."""
    kw = dict(
        size={"shortest_edge": d.min_pixels, "longest_edge": d.video_total_pixels},
        min_frames=d.video_min_frames, max_frames=d.video_max_frames, fps=d.video_fps,
        patch_size=ip.patch_size, merge_size=ip.merge_size, temporal_patch_size=ip.temporal_patch_size,
        image_mean=ip.image_mean, image_std=ip.image_std,
    )  # fmt: skip
    capped = hasattr(hf_video.Qwen3VLVideoProcessor, "get_num_of_video_patches")  # 5.x has the per-frame cap
    if capped:
        kw.update(cap_pixels_per_frame=True, max_video_tokens=d.video_max_pixels // (ip.patch_size * ip.merge_size) ** 2)
    vp = hf_video.Qwen3VLVideoProcessor(**kw)
    meta = VideoMetadata(total_num_frames=FRAMES, fps=float(FPS))
    indices = vp.sample_frames(meta).tolist()
    n, (w, h), factor = len(indices), SIZE, ip.patch_size * ip.merge_size
    # HF's resize (5.x, cap_pixels_per_frame): the volume bound is n x the per-frame share
    per_frame = max(min(d.video_max_pixels, d.video_total_pixels // n), int(d.min_pixels * 1.05))
    rh, rw = hf_video.smart_resize(n, h, w, temporal_factor=2, factor=factor, min_pixels=d.min_pixels, max_pixels=per_frame * n)
    grid = (-(-n // 2), rh // ip.patch_size, rw // ip.patch_size)
    if capped:
        assert vp.get_num_of_video_patches(n, h, w) == grid[0] * grid[1] * grid[2]
    times = Qwen3VLProcessor._calculate_timestamps(None, list(indices), float(FPS), 2)
    meta.frames_indices = np.asarray(indices)
    if hasattr(Qwen3VLProcessor, "replace_video_token"):  # 5.x: the processor's own expansion
        fake = types.SimpleNamespace(
            video_processor=vp, vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
            video_token="<|video_pad|>", _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a),
        )  # fmt: skip
        text = Qwen3VLProcessor.replace_video_token(fake, {"video_grid_thw": [torch.tensor(grid)], "video_metadata": [meta]}, 0)
    else:  # 4.57: the same loop inside Qwen3VLProcessor.__call__
        pads = "<|video_pad|>" * (grid[1] * grid[2] // 4)
        text = "".join(f"<{t:.1f} seconds><|vision_start|>{pads}<|vision_end|>" for t in times[: grid[0]])
    return indices, grid, times, text, (vp if capped else None)


def test_video_tokens_times_and_patches_equal_hf(tmp_path, processor):
    pytest.importorskip("av")
    from videos import LOSSLESS, decode_all, write_video

    clip = write_video(tmp_path / "clip.avi", *SIZE, FRAMES, FPS, codec=LOSSLESS)
    row = _row("Watch <video> What moves?", videos=[clip.name])
    (tmp_path / "d.json").write_text(json.dumps([row]))
    cfg = make_cfg(path=str(tmp_path / "d.json"), shuffle=False, video_min_frames=2)
    dataset, _ = read_dataset(cfg.data, processor)
    sample = dataset[0]
    indices, grid, times, placeholder, vp = _hf_video_reference(cfg.data, processor.image_processor)

    plan = dataset.video_processor.plan(dataset.index.videos(0)[0], dataset.conversation(0).where, "v")
    assert list(plan.indices) == indices and plan.grid == grid and len(indices) % 2 == 1
    assert plan.timestamps == pytest.approx(times)
    assert sample["video_grid_thw"].tolist() == [list(grid)]
    assert "second_per_grid_ts" not in sample  # the time is the text; 4.57's get_rope_index refuses it

    template = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Watch "}, {"type": "video"},
                                      {"type": "text", "text": " What moves?"}]},
         {"role": "assistant", "content": "A red square."}],
        tokenize=False,
    )  # fmt: skip
    text = template.replace("<|vision_start|><|video_pad|><|vision_end|>", placeholder)
    assert sample["input_ids"].tolist() == processor.tokenizer.encode(text, add_special_tokens=False)
    ids = sample["input_ids"]
    assert [e - s for s, e in runs(ids == processor.video_token_id)] == [grid[1] * grid[2] // 4] * grid[0]
    _assert_assistant_only(sample, row, processor.tokenizer)
    if needs_mm_token_type_ids():
        assert torch.equal(sample["mm_token_type_ids"] == 2, ids == processor.video_token_id)

    if vp is not None:  # 5.x: HF's patch layout of the same frames, normalised with the same constants
        frames = np.stack([decode_all(clip)[0][i] for i in indices])  # [n, H, W, 3]
        x = torch.from_numpy(frames).float().permute(0, 3, 1, 2)[None] / 255  # [1, n, 3, H, W]
        mean = torch.tensor(vp.image_mean).view(1, 1, 3, 1, 1)
        x = (x - mean) / torch.tensor(vp.image_std).view(1, 1, 3, 1, 1)
        ref, *hf_grid = vp.patchify(x, patch_size=vp.patch_size, merge_size=vp.merge_size, temporal_patch_size=2)
        assert tuple(hf_grid) == grid
        torch.testing.assert_close(sample["pixel_values_videos"], ref[0], rtol=0, atol=2e-6)  # fp32 rounding of (x-m)/s


def test_the_index_is_keyed_by_the_family(tmp_path, processor):
    """The same rows under Qwen2.5-VL and Qwen3-VL: each family scans its own index; even a
    processor whose files are equal but whose family differs does not read the other's."""
    names = [_image(tmp_path / "a.png", 90, 60, 0)]
    (tmp_path / "d.json").write_text(json.dumps([_row("<image>Colour?", images=names)] * 3))
    data = make_cfg(path=str(tmp_path / "d.json"), cache_dir=str(tmp_path / "cache")).data
    qwen2 = Processor.from_pretrained(tiny_checkpoint("qwen2_5_vl"))
    first, _ = read_dataset(data, qwen2)
    assert read_dataset(data, qwen2)[0].index_origin.startswith("index from cache")
    ours, _ = read_dataset(data, processor)
    assert ours.index_origin.startswith("scanned")
    assert first.lengths.tolist() != ours.lengths.tolist()  # 28- vs 32-px tokens, a system turn or none
    relabelled = Processor(processor.tokenizer, processor.image_processor, family=families.get("qwen3_vl_moe"))
    assert read_dataset(data, relabelled)[0].index_origin.startswith("scanned")
    assert len(list((tmp_path / "cache").iterdir())) == 3


def test_a_lora_export_processor_has_its_base_models_family(tmp_path, processor):
    """A peft adapter directory has no config.json: its family is its base model's (else the
    Qwen2.5-VL template would encode a Qwen3-VL eval set, with another system turn)."""
    processor.save_pretrained(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_checkpoint(QWEN3))}))
    assert Processor.from_pretrained(tmp_path).family.name == QWEN3
    (tmp_path / "adapter_config.json").unlink()
    assert Processor.from_pretrained(tmp_path).family.name == "qwen2_5_vl"  # processor files alone: the default family
