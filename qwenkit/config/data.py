"""``data``: where the rows are, how they are read, checked, cut and batched, and the held-out set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# qwenkit.data.layouts.NAMES (the data floor sits above this module; a test keeps the two equal)
DATA_LAYOUTS = (
    "auto", "messages", "sharegpt", "llava", "typed", "qwen_vl", "swift_conversation", "swift_query", "alpaca",
    "cauldron", "prompt",
)  # fmt: skip


@dataclass
class DataConfig:
    path: str = "tiny"  # "tiny" (embedded synthetic set), a JSON/JSONL file, a directory, or an HF dataset dir
    layout: Literal[DATA_LAYOUTS] = "auto"  # row layout (docs/DATA.md); auto: detected per row
    image_dir: str | None = None  # base for relative image paths (default: the dataset file's directory)
    system_prompt: str | None = None  # rows without a system turn; None: the family's (Qwen2.5-VL's default text, Qwen3-VL none)
    max_length: int = 1024  # tokens per sample, images included
    truncate_text: bool = False  # over-long samples: cut text after the last image instead of dropping
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 256
    min_image_side: int = 28  # smaller images are bad samples
    max_aspect_ratio: float = 200.0  # Qwen2-VL's processor refuses more extreme images
    video_dir: str | None = None  # base for relative video paths (default: data.image_dir, else the file's directory)
    video_fps: float = 2.0  # frames sampled per second of video
    video_min_frames: int = 4  # videos with fewer decodable frames are bad samples (short_video)
    video_max_frames: int = 128  # sampled frames per video at most (longer videos are sampled sparser)
    video_max_pixels: int = 28 * 28 * 128  # per frame; the lower bound is data.min_pixels
    video_total_pixels: int = 28 * 28 * 2048  # per video, all frames: caps a video near this/784 tokens
    on_bad_sample: Literal["error", "skip"] = "skip"
    max_bad_fraction: float = 0.01  # training fails if more than this fraction is skipped
    shuffle: bool = True
    num_workers: int = 0
    packing: bool = False  # padding-free: each micro-batch is one row of its samples, attention kept per sample
    max_tokens_per_batch: int = 0  # >0: fill micro-batches up to this many tokens (train.micro_batch_size unused)
    tiny_samples: int = 64  # size of the embedded synthetic dataset (path=tiny)
    # path=tiny: the synthetic task: coloured shapes (images), tones (audio: which pitch, low/mid/high; a family
    # with an audio tower), tools (the shapes asked through the agentic task's tools: multi-turn tool SFT) or
    # tool_questions (those rows' questions and final answers alone: the agentic GRPO recipe's prompts)
    tiny_task: Literal["shapes", "tones", "tools", "tool_questions"] = "shapes"
    # every <video> heard with its own audio track, interleaved with its frames (HF's use_audio_in_video; a family
    # with an audio tower; a video without a track is a bad row, docs/DATA.md)
    use_audio_in_video: bool = False
    cache_dir: str | None = None  # prepared-index cache; None: $QWENKIT_CACHE/data-index (~/.cache/qwenkit/data-index)
    fingerprint: Literal["stat", "content"] = "stat"  # data files keyed by path/size/mtime, or by a content hash
    num_proc: int = 1  # scan processes per rank on a cold cache (rows are also split across ranks)
    verify_images: Literal["header", "full"] = "header"  # scan: header (+ end marker) or a full decode
    eval_path: str | None = None  # held-out set, any format data.path takes
    eval_fraction: float = 0.0  # or hold out this fraction of data.path's rows (split by train.seed)
    tiny_eval_samples: int = 0  # path=tiny: held-out synthetic rows drawn with another seed (0: none)
