"""The rules of ``data``."""

from __future__ import annotations

from qwenkit.config.schema import Config, Need
from qwenkit.config.train import OBJECTIVES
from qwenkit.model.families.registry import FAMILIES


def check(cfg: Config, need: Need) -> None:
    data, loss = cfg.data, cfg.loss
    need(data.max_length > 0, f"data.max_length must be > 0, got {data.max_length}")
    need(data.min_pixels > 0, f"data.min_pixels must be > 0, got {data.min_pixels}")
    need(
        data.max_pixels >= data.min_pixels,
        f"data.max_pixels must be >= data.min_pixels ({data.min_pixels}), got {data.max_pixels}",
    )
    need(data.min_image_side >= 1, f"data.min_image_side must be >= 1, got {data.min_image_side}")
    need(data.max_aspect_ratio >= 1, f"data.max_aspect_ratio must be >= 1, got {data.max_aspect_ratio}")
    need(data.video_fps > 0, f"data.video_fps must be > 0, got {data.video_fps}")
    need(
        data.video_min_frames >= 2,
        f"data.video_min_frames must be >= 2 (one temporal patch), got {data.video_min_frames}",
    )
    need(
        data.video_max_frames >= data.video_min_frames,
        f"data.video_max_frames must be >= data.video_min_frames ({data.video_min_frames}), got {data.video_max_frames}",
    )
    need(
        data.video_max_pixels >= data.min_pixels,
        f"data.video_max_pixels must be >= data.min_pixels ({data.min_pixels}), got {data.video_max_pixels}",
    )
    need(
        data.video_total_pixels >= data.min_pixels,
        f"data.video_total_pixels must be >= data.min_pixels ({data.min_pixels}), got {data.video_total_pixels}",
    )
    need(
        0.0 <= data.max_bad_fraction <= 1.0,
        f"data.max_bad_fraction must be in [0, 1], got {data.max_bad_fraction}",
    )
    need(data.num_workers >= 0, f"data.num_workers must be >= 0, got {data.num_workers}")
    need(data.tiny_samples > 0, f"data.tiny_samples must be > 0, got {data.tiny_samples}")
    need(data.max_tokens_per_batch >= 0, f"data.max_tokens_per_batch must be >= 0 (0: off), got {data.max_tokens_per_batch}")
    if data.max_tokens_per_batch:
        need(
            data.max_tokens_per_batch >= data.max_length,
            f"data.max_tokens_per_batch={data.max_tokens_per_batch} is below data.max_length={data.max_length}: "
            "a sample of the longest allowed length would fit in no micro-batch",
        )
    if data.packing:
        need(
            loss.loss_type != "sample_mean",
            "loss.loss_type: 'sample_mean' is not available with data.packing=true "
            "(a packed row is one row of several samples); use token_mean or data.packing=false",
        )
    need(data.num_proc >= 1, f"data.num_proc must be >= 1, got {data.num_proc}")
    need(0.0 <= data.eval_fraction < 1.0, f"data.eval_fraction must be in [0, 1), got {data.eval_fraction}")
    need(
        data.eval_path is None or data.eval_fraction == 0.0,
        f"data.eval_path ({data.eval_path!r}) and data.eval_fraction ({data.eval_fraction}) both give an eval set; keep one",
    )
    need(data.tiny_eval_samples >= 0, f"data.tiny_eval_samples must be >= 0, got {data.tiny_eval_samples}")
    reads = OBJECTIVES[cfg.train.objective].reads if cfg.train.objective in OBJECTIVES else "conversations"
    if data.use_audio_in_video:
        _check_audio_in_video(cfg, need)
    need(
        data.path != "tiny" or data.tiny_task == "shapes" or reads == "conversations"
        or (data.tiny_task == "tool_questions" and reads == "prompts"),
        f"data.tiny_task={data.tiny_task!r} is a conversation task; train.objective={cfg.train.objective!r} reads "
        f"{reads} (the tiny ones are the shapes'{' and tool_questions (prompts)' if reads == 'prompts' else ''}): "
        "use data.tiny_task=shapes",
    )


def _check_audio_in_video(cfg: Config, need: Need) -> None:
    """``data.use_audio_in_video=true``: a family that hears (every objective: the training forward and the
    kit's generation both give the thinker ``use_audio_in_video``, :func:`qwenkit.model.families.positions.thinker_keywords`)."""
    family = FAMILIES.get(cfg.model.name)  # None: model.name=auto, the scan names each video row instead
    need(
        family is None or bool(family.audio_tokens),
        f"data.use_audio_in_video=true hears each video's audio track, but model.name={cfg.model.name!r} has no "
        "audio tower; use an Omni family (README's family table) or data.use_audio_in_video=false",
    )
