"""Video rows: PyAV decoding of every container, frame sampling, resizing and patches against a
reference built here from the documented algorithm (and the image processor for the spatial
part), the template, every bad-video reason, the model forward against HF's, and the
acceptance set in LLaMA-Factory's mllm_video_demo layout (data check + 2 training steps).

All videos are written here with PyAV (see tests/videos.py).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hf_reference_ids, make_cfg, runs, write_png
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration
from videos import LOSSLESS, decode_all, frame, write_video

from qwenkit import config as qconfig
from qwenkit.cli import main as cli_main
from qwenkit.data import DataError, build, read_dataset
from qwenkit.data.images import MediaRef
from qwenkit.data.report import Location
from qwenkit.data.video import VideoMeta, VideoProcessor, probe
from qwenkit.engine.run import train
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.processor import Processor, needs_mm_token_type_ids

pytest.importorskip("av")

HERE = Location("test.json", row=0)


def video_row(text="<video>What moves?", reply="A red square.", videos=("clip.avi",), images=()):
    row = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]}
    if videos:
        row["videos"] = list(videos)
    if images:
        row["images"] = list(images)
    return row


# ---------------------------------------------------------------------------------------------
# Decoding, sampling, resizing, patches


@pytest.mark.parametrize("suffix", [".mp4", ".avi", ".mkv", ".webm", ".mov"])
def test_every_container_decodes_with_its_frame_count_and_rate(tmp_path, suffix):
    path = write_video(tmp_path / f"clip{suffix}", 64, 48, 12, 8)
    assert probe(MediaRef("v", path=path), HERE) == VideoMeta(12, 8.0, 64, 48)


def reference_pixels(path: Path, d, ip) -> tuple[list[int], tuple, np.ndarray, float]:
    """The documented algorithm written out plainly: frames, indices, size, patches by loops."""
    frames, rate = decode_all(path)
    total = len(frames)
    n = total / rate * d.video_fps  # frames wanted at data.video_fps
    n = max(n, 2 * math.ceil(d.video_min_frames / 2))
    n = min(n, 2 * (min(d.video_max_frames, total) // 2))
    n = 2 * int(n // 2)
    indices = [int(round(float(v))) for v in np.linspace(0, total - 1, n)]
    h, w = frames[0].shape[:2]
    budget = max(min(d.video_max_pixels, d.video_total_pixels * 2 // n), int(d.min_pixels * 1.05))
    # smart_resize, factor 28: round to multiples of 28, then scale into [min_pixels, budget]
    rh, rw = round(h / 28) * 28, round(w / 28) * 28
    if rh * rw > budget:
        beta = math.sqrt(h * w / budget)
        rh, rw = max(28, math.floor(h / beta / 28) * 28), max(28, math.floor(w / beta / 28) * 28)
    elif rh * rw < d.min_pixels:
        beta = math.sqrt(d.min_pixels / (h * w))
        rh, rw = math.ceil(h * beta / 28) * 28, math.ceil(w * beta / 28) * 28
    mean, std = np.array(ip.image_mean), np.array(ip.image_std)
    chw = [
        ((np.asarray(Image.fromarray(frames[i]).resize((rw, rh), Image.Resampling.BICUBIC)) / 255.0 - mean) / std).transpose(2, 0, 1)
        for i in indices
    ]
    rows = []
    for t in range(n // 2):
        pair = np.stack(chw[2 * t : 2 * t + 2])  # [T, C, H, W]
        for by in range(rh // 28):
            for bx in range(rw // 28):
                for my in range(2):
                    for mx in range(2):
                        y, x = (2 * by + my) * 14, (2 * bx + mx) * 14
                        rows.append(pair[:, :, y : y + 14, x : x + 14].transpose(1, 0, 2, 3).reshape(-1))  # C, T, p, p
    seconds = 2 / (n / total * rate)
    return indices, (n // 2, rh // 14, rw // 14), np.stack(rows), seconds


@pytest.mark.parametrize(
    "size, frames, fps, data",
    [
        ((101, 75), 45, 15, {}),  # odd size, 3 s at 2 fps: 6 frames
        ((64, 48), 90, 30, {"video_max_frames": 5}),  # clamped to 5, floored to 4
        ((64, 48), 6, 30, {"video_min_frames": 5}),  # 0.2 s wants 0.4 frames: clamped up to 6
        ((330, 250), 40, 10, {"video_fps": 3.0, "video_total_pixels": 28 * 28 * 40}),  # total budget shrinks frames
        ((40, 30), 9, 3, {"video_min_frames": 3}),  # 9 frames at 3 fps: 6 sampled, upscaled to min_pixels
    ],
)
def test_frames_grid_and_pixels_equal_the_reference(tmp_path, processor, size, frames, fps, data):
    path = write_video(tmp_path / "clip.avi", *size, frames, fps, codec=LOSSLESS)
    d = make_cfg(**data).data
    vp = VideoProcessor.from_config(processor.image_processor, d)
    ref = MediaRef("v", path=path)
    pixels, plan = vp.load(ref, probe(ref, HERE), HERE)
    indices, grid, expected, seconds = reference_pixels(path, d, processor.image_processor)
    assert list(plan.indices) == indices and plan.grid == grid
    # the lossless codec kept each frame's own index: these are the frames the plan names
    got = decode_all(path)[0]
    assert [int(got[i][0, 0, 2]) for i in plan.indices] == indices
    assert plan.second_per_grid == pytest.approx(seconds)
    torch.testing.assert_close(pixels, torch.from_numpy(expected).float(), rtol=0, atol=2e-6)


def test_spatial_part_equals_the_image_processor(tiny_path):
    """Frames A A B B make a 2-patch video; the image processor repeats a still image in time,
    so its patches of A and of B, concatenated, must be the video's patches."""
    d = make_cfg().data
    vp = VideoProcessor.from_config(Processor.from_pretrained(tiny_path).image_processor, d)
    a, b = frame(3, 150, 97), frame(40, 150, 97)
    plan = vp.plan(VideoMeta(4, 2.0, 150, 97), HERE, "v")
    h, w = plan.size
    same = Processor.from_pretrained(tiny_path, min_pixels=h * w, max_pixels=h * w).image_processor
    ref = same(images=[Image.fromarray(a), Image.fromarray(b)], return_tensors="pt")
    assert plan.grid == (2, *ref["image_grid_thw"][0, 1:].tolist())
    torch.testing.assert_close(vp.pixels([a, a, b, b], plan), torch.as_tensor(ref["pixel_values"]), rtol=0, atol=1e-5)


def test_pyav_missing_names_the_extra(tmp_path, processor, monkeypatch):
    write_video(tmp_path / "clip.avi", 64, 48, 8, 4)
    (tmp_path / "data.json").write_text(json.dumps([video_row()]))
    monkeypatch.setitem(sys.modules, "av", None)  # import av now raises ImportError
    with pytest.raises(DataError, match=r"qwenkit\[video\]"):
        read_dataset(make_cfg().data, processor, str(tmp_path / "data.json"))


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (["data.video_fps=0"], "data.video_fps must be > 0"),
        (["data.video_min_frames=1"], "data.video_min_frames must be >= 2"),
        (["data.video_min_frames=8", "data.video_max_frames=4"], "data.video_max_frames must be >= data.video_min_frames"),
        (["data.video_max_pixels=100"], "data.video_max_pixels must be >= data.min_pixels"),
        (["data.video_total_pixels=100"], "data.video_total_pixels must be >= data.min_pixels"),
    ],
)
def test_video_settings_are_validated(overrides, problem):
    with pytest.raises(qconfig.ConfigError, match=problem):
        qconfig.load(overrides=overrides)


# ---------------------------------------------------------------------------------------------
# Rows, template, batch


def write_mixed_set(root: Path) -> Path:
    write_video(root / "clips" / "a.avi", 96, 72, 20, 10)
    write_video(root / "clips" / "b.mp4", 120, 64, 16, 8)
    write_png(root / "red.png")
    rows = [
        video_row("<video>What moves?", videos=["clips/a.avi"]),
        video_row("Look: <image> and <video>, then <video>.", "Red, then two clips.", ["clips/a.avi", "clips/b.mp4"], ["red.png"]),
    ]
    (root / "data.json").write_text(json.dumps(rows))
    return root / "data.json"


def test_template_batch_and_hf_chat_template(tmp_path, processor):
    path = write_mixed_set(tmp_path)
    cfg = make_cfg(path=str(path), shuffle=False)
    bundle = build(cfg, processor)
    assert (len(bundle.dataset), bundle.report.skipped) == (2, 0)
    samples = [bundle.dataset[i] for i in range(2)]
    batch = bundle.collator(samples)
    vgrids = batch["video_grid_thw"]
    assert vgrids.tolist() == [list(g) for s in bundle.dataset.samples for g in s.video_grids]
    assert batch["pixel_values_videos"].shape == (int(vgrids.prod(-1).sum()), 3 * 2 * 14 * 14)
    assert batch["image_grid_thw"].shape == (1, 3)
    # second_per_grid_ts: 2 frames / sampling rate; a.avi 20 frames at 10 fps sampled at 2 fps -> 1 s
    assert batch["second_per_grid_ts"].tolist() == pytest.approx([1.0, 1.0, 2 / (4 / 16 * 8)])

    rows = json.loads(path.read_text())
    video = 0
    for sample, row in zip(samples, rows):
        ids = sample["input_ids"]
        spans = runs(ids == processor.video_token_id)
        n_videos = len(row["videos"])
        assert [e - s for s, e in spans] == [int(g.prod()) // 4 for g in vgrids[video : video + n_videos]]
        for s, e in spans:
            assert ids[s - 1] == processor.vision_start_id and ids[e] == processor.vision_end_id
        video += n_videos
        # the checkpoint's own chat template, each pad expanded to its span, gives the same ids
        assert ids.tolist() == hf_reference_ids(processor, row, sample.get("image_grid_thw", []), sample["video_grid_thw"])
        if needs_mm_token_type_ids():
            types = sample["mm_token_type_ids"]
            assert torch.equal(types == 2, ids == processor.video_token_id)
            assert torch.equal(types == 1, ids == processor.image_token_id)
        else:
            assert "mm_token_type_ids" not in sample
    assert batch["num_items"] == (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def test_video_entries_relative_absolute_dirs_and_bytes(tmp_path, processor):
    clip = write_video(tmp_path / "media" / "clip.avi", 64, 48, 8, 4)
    (tmp_path / "data.json").write_text(json.dumps([video_row(), video_row(videos=[str(clip)])]))
    for key in ("video_dir", "image_dir"):
        dataset, report = read_dataset(make_cfg(**{key: str(tmp_path / "media")}).data, processor, str(tmp_path / "data.json"))
        assert (len(dataset), report.skipped) == (2, 0), key
    _, report = read_dataset(make_cfg().data, processor, str(tmp_path / "data.json"))
    assert report.by_reason == {"missing_video": 1}  # relative to the file's directory: not there
    # an HF dataset with the clip's bytes embedded, as a Video/binary column holds them
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([video_row(videos=[{"bytes": clip.read_bytes(), "path": "clip.avi"}])])
    dataset, report = read_dataset(make_cfg().data, processor, ds)
    assert (len(dataset), report.skipped) == (1, 0)
    assert dataset[0]["video_grid_thw"].tolist() == [list(dataset.samples[0].video_grids[0])]


# ---------------------------------------------------------------------------------------------
# Bad videos: file, row, reason


def bad_set(tmp_path: Path, bad_row: dict) -> Path:
    write_video(tmp_path / "clip.avi", 64, 48, 10, 5)
    (tmp_path / "data.json").write_text(json.dumps([video_row(), video_row(), bad_row]))
    return tmp_path / "data.json"


def write_text_file(path: Path) -> str:
    path.write_text("not a video")
    return path.name


@pytest.mark.parametrize(
    "make, reason, detail",
    [
        (lambda p: video_row(videos=["nope.mp4"]), "missing_video", "video 0 of 1 ('nope.mp4'): no such file"),
        (lambda p: video_row(videos=[write_video(p / "cut.mp4", 64, 48, 20, 10, truncate=0.4).name]), "corrupt_video", "cannot decode"),
        (lambda p: video_row(videos=[write_video(p / "cut.avi", 64, 48, 20, 10, truncate=0.1).name]), "corrupt_video", "the header promises 20 frames but only"),
        (lambda p: video_row(videos=[write_text_file(p / "text.mp4")]), "corrupt_video", "cannot decode"),
        (lambda p: video_row(videos=["clip.avi", "clip.avi"]), "video_count", "1 <video> placeholder but 2 videos"),
        (lambda p: video_row(text="<video><video>Two?"), "video_count", "2 <video> placeholders but 1 video"),
        (lambda p: video_row(text="Hi", reply="<video>"), "video_count", "message 1 (assistant) contains <video>"),
        (lambda p: video_row(videos=[write_video(p / "short.avi", 64, 48, 3, 10).name]), "short_video", "has 3 frames, fewer than data.video_min_frames=4"),
        (lambda p: video_row(videos=[write_video(p / "long.avi", 640, 360, 24, 2).name]), "too_long", "tokens > data.max_length=1024"),
    ],
    ids=["missing", "truncated-mp4", "truncated-avi", "not-a-video", "more-videos", "more-placeholders", "in-reply", "short", "too-long"],
)
def test_bad_video_names_file_row_and_reason(tmp_path, processor, make, reason, detail):
    path = bad_set(tmp_path, make(tmp_path))
    dataset, report = read_dataset(make_cfg().data, processor, str(path))
    assert report.by_reason == {reason: 1}, report.messages
    assert len(dataset) == 2
    message = report.messages[0]
    assert message.startswith(f"{path}: row 2: {reason}: ") and detail in message, message


def test_data_check_lists_bad_videos(tmp_path, capsys):
    path = bad_set(tmp_path, video_row(videos=["nope.mp4"]))
    assert cli_main(["data", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "samples: 2 good, 1 bad" in out and "videos: 2, 4.0 s, 20 frames decoded, 8 sampled" in out
    assert f"{path}: row 2: missing_video" in out


# ---------------------------------------------------------------------------------------------
# The model on a video batch: chunk head vs HF's own class, and real seconds in mRoPE


def test_video_batch_forward_equals_hf(tmp_path, processor, make_model, tiny_path):
    bundle = build(make_cfg(path=str(write_mixed_set(tmp_path)), shuffle=False), processor)
    batch = bundle.collator([bundle.dataset[i] for i in range(2)])
    batch.pop("num_samples")
    num_items = batch.pop("num_items")
    ours_full, ours_chunk = make_model(chunk=False, seed=1), make_model(chunk=True, seed=1)
    ours_chunk.configure_loss(chunk=True, chunk_size=64)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_path, dtype=torch.float32)
    hf.load_state_dict(ours_full.state_dict())
    results = []
    for model in (hf, ours_full, ours_chunk):
        model.zero_grad(set_to_none=True)
        loss = model(**batch, num_items_in_batch=num_items).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((loss.detach(), grads))
    (l0, g0) = results[0]
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, l0, rtol=1e-5, atol=1e-7)
        for name, g in g0.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    assert g0["model.visual.patch_embed.proj.weight"].abs().sum() > 0

    # mRoPE time positions step by tokens_per_second x second_per_grid_ts per temporal patch
    kwargs = {k: batch[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "attention_mask")}
    if needs_mm_token_type_ids():
        kwargs["mm_token_type_ids"] = batch["mm_token_type_ids"]
    positions, _ = hf.model.get_rope_index(batch["input_ids"], **kwargs)  # [3, B, S]
    tps = hf.config.vision_config.tokens_per_second
    grid, seconds = batch["video_grid_thw"][0], float(batch["second_per_grid_ts"][0])
    span = runs(batch["input_ids"][0] == processor.video_token_id)[0]
    times = positions[0, 0, span[0] : span[1]].view(int(grid[0]), -1)
    start = positions[0, 0, span[0] - 1] + 1
    assert times.tolist() == [[int(start + int(k * tps * seconds))] * times.shape[1] for k in range(int(grid[0]))]


# ---------------------------------------------------------------------------------------------
# Acceptance: LLaMA-Factory's mllm_video_demo layout


@pytest.fixture(scope="module")
def video_demo(tmp_path_factory) -> Path:
    """Three rows, mp4 and avi clips of 6-10 s between 320x240 and 640x360, as in LLaMA-Factory's
    data/mllm_video_demo.json (videos under mllm_demo_data/)."""
    root = tmp_path_factory.mktemp("mllm_video_demo")
    clips = [("1.mp4", 320, 240, 6), ("2.avi", 480, 270, 8), ("3.mp4", 640, 360, 10)]
    for name, w, h, seconds in clips:
        write_video(root / "mllm_demo_data" / name, w, h, seconds * 10, 10)
    qa = [
        ("<video>Why is this video funny?", "Because a red square races a green disc and loses."),
        ("<video>What is she doing?", "She is not there: only shapes move from left to right."),
        ("What is this video about?<video>", "Two shapes cross a gradient background."),
    ]
    rows = [
        {"messages": [{"content": q, "role": "user"}, {"content": a, "role": "assistant"}], "videos": [f"mllm_demo_data/{c[0]}"]}
        for (q, a), c in zip(qa, clips)
    ]
    (root / "mllm_video_demo.json").write_text(json.dumps(rows, indent=2))
    return root / "mllm_video_demo.json"


def test_video_demo_passes_data_check(video_demo, capsys):
    assert cli_main(["data", "check", str(video_demo), "data.max_length=8192"]) == 0
    out = capsys.readouterr().out
    assert "samples: 3 good, 0 bad, 3 rows read" in out
    assert "videos: 3, 24.0 s, 240 frames decoded, 48 sampled" in out
    assert out.rstrip().endswith("OK")


def test_video_demo_trains_two_steps(video_demo, tmp_path):
    cfg = qconfig.load(
        overrides=[
            f"data.path={video_demo}", "data.max_length=8192", "train.steps=2", "train.micro_batch_size=1",
            "train.resume=none", "checkpoint.save_final=false", f"train.output_dir={tmp_path}",
        ]
    )  # fmt: skip
    trainer = train.run(cfg)
    assert len(trainer.history) == 2
    assert all(math.isfinite(h["loss"]) for h in trainer.history)
