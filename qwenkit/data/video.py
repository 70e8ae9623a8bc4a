"""Video entries → PyAV-decoded frames → the patches, grid and time step Qwen2.5-VL takes.

transformers' Qwen2-VL video processor imports torchvision (kept optional, see the README), so
this module does its work with PyAV (FFmpeg bindings, the ``video`` extra), PIL and numpy. Video
entries in a row resolve like images (:func:`qwenkit.data.images.resolve`, base directory
``data.video_dir``, else ``data.image_dir``, else the dataset file's directory).

1. **Probe** (:func:`probe`, at scan time): decode every frame once, without colour conversion,
   so a truncated or corrupt file is a bad sample now and not at step 9,000; keep
   :class:`VideoMeta` (decodable frames, frame rate, frame size).
2. **Plan** (:meth:`VideoProcessor.plan`, from the metadata alone, as qwen-vl-utils does):
   ``n = frames / fps · data.video_fps``, clamped to ``[video_min_frames, min(video_max_frames,
   frames)]`` and floored to a multiple of the temporal patch (2); frame indices are
   ``linspace(0, frames - 1, n)`` rounded. Each frame is smart-resized (factor ``patch · merge``
   = 28) into ``[data.min_pixels, max(min(video_max_pixels, video_total_pixels · 2 // n),
   1.05 · min_pixels)]``, the per-frame share of the video's total budget that transformers'
   Qwen2-VL video processor applies with ``cap_pixels_per_frame``. The grid is
   ``(n / 2, h / 14, w / 14)``; a video costs ``t·h·w / 4`` ``<|video_pad|>`` tokens.
3. **Pixels** (:meth:`VideoProcessor.load`): decode again keeping only the planned frames,
   resize each with PIL bicubic (as the image processor does), rescale and normalise with the
   image processor's constants, and flatten to ``[t·h·w, C·2·14²]`` in the image processor's
   order (merge windows contiguous), so the vision tower reads videos as it reads images.
4. **Time**: ``second_per_grid = 2 / sample_fps`` with ``sample_fps = n / frames · fps``, the
   real seconds between two temporal patches, which mRoPE turns into time positions.

A video may also be a list of frame files (qwen-vl-utils' and LLaMA-Factory's ``"video": [...]``):
each frame is read with PIL (converted to RGB as images are), all frames must have one size, and
the list is then a video of ``len(frames)`` frames at the row's ``fps`` (else ``data.video_fps``,
so every frame is kept up to ``video_max_frames``), planned and resized exactly as a decoded one.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from qwenkit.data.images import CachedProbe, MediaRef, Unreadable, decode_rgb, smart_resize
from qwenkit.data.reader import DataError
from qwenkit.data.report import REBUILD, BadSample, Location


@dataclass(frozen=True)
class VideoMeta:
    """What the probe measured: everything :meth:`VideoProcessor.plan` needs."""

    frames: int  # frames that decode
    fps: float  # the stream's average frame rate
    width: int
    height: int


@dataclass(frozen=True)
class VideoPlan:
    indices: tuple[int, ...]  # sampled frames, in order
    grid: tuple[int, int, int]  # (t, h, w) in patches
    size: tuple[int, int]  # (height, width) every sampled frame is resized to
    second_per_grid: float  # seconds between two temporal patches (Qwen2.5-VL's mRoPE time step)
    timestamps: tuple[float, ...] = ()  # seconds of each temporal patch (the text Qwen3-VL's template writes)


def import_av():
    """PyAV, imported only when a dataset holds videos."""
    try:
        import av
    except ImportError:
        raise DataError(
            "the dataset has videos; reading them needs PyAV (FFmpeg bindings): pip install 'qwenkit[video]'"
        ) from None
    return av


def _decode_frames(
    ref: MediaRef, keep: frozenset[int], default_fps: float
) -> tuple[VideoMeta, dict[int, np.ndarray]]:
    """A video given as frame files: every frame decoded (so a bad one shows now), ``keep`` kept."""
    kept: dict[int, np.ndarray] = {}
    size = None
    for k, frame in enumerate(ref.frames):
        try:
            im = decode_rgb(frame)
        except Unreadable as e:
            reason = {"missing_image": "missing_video", "corrupt_image": "corrupt_video"}[e.reason]
            raise Unreadable(reason, f"{frame.label}: {e.detail}") from None
        if size is None:
            size = im.size
        elif im.size != size:
            raise Unreadable(
                "corrupt_video", f"{frame.label} is {im.size[0]}x{im.size[1]} px, frame 0 is {size[0]}x{size[1]}"
            )
        if k in keep:
            kept[k] = np.asarray(im)  # [H, W, 3] uint8
    fps = float(ref.fps) if ref.fps is not None else float(default_fps)
    return VideoMeta(len(ref.frames), fps, size[0], size[1]), kept


def _decode(
    ref: MediaRef, keep: frozenset[int] = frozenset(), default_fps: float = 2.0
) -> tuple[VideoMeta, dict[int, np.ndarray]]:
    """Decode every frame of the first video stream; return the metadata and frames ``keep`` as RGB.

    ``default_fps`` is the frame rate of a list of frame files whose row gives none."""
    if ref.frames is not None:
        return _decode_frames(ref, keep, default_fps)
    av = import_av()
    if ref.data is None and not ref.path.is_file():
        raise Unreadable("missing_video", f"no such file {str(ref.path)!r}")
    source = io.BytesIO(ref.data) if ref.data is not None else str(ref.path)
    kept: dict[int, np.ndarray] = {}
    n = width = height = 0
    try:
        with av.open(source) as container:
            if not container.streams.video:
                raise Unreadable("corrupt_video", "the file has no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            rate = stream.average_rate or stream.guessed_rate
            declared = stream.frames  # 0 when the container does not say (mkv, webm)
            for frame in container.decode(stream):
                if n == 0:
                    width, height = frame.width, frame.height
                if n in keep:
                    kept[n] = frame.to_ndarray(format="rgb24")  # [H, W, 3] uint8
                n += 1
    except (av.FFmpegError, OSError, ValueError) as e:
        raise Unreadable("corrupt_video", f"cannot decode: {e}") from None
    if n == 0:
        raise Unreadable("corrupt_video", "no frame decodes")
    if n < declared:
        raise Unreadable("corrupt_video", f"the header promises {declared} frames but only {n} decode (truncated?)")
    if not rate or rate <= 0:
        raise Unreadable("corrupt_video", "the stream has no frame rate")
    return VideoMeta(n, float(rate), width, height), kept


def probe(ref: MediaRef, where: Location, default_fps: float = 2.0) -> VideoMeta:
    """Decode the whole video once (so truncation shows) and measure it; raises :class:`BadSample`."""
    try:
        return _decode(ref, default_fps=default_fps)[0]
    except Unreadable as e:
        raise e.bad_sample(ref, where) from None


class VideoProbe:
    """:func:`probe` with a cache (:class:`~qwenkit.data.images.CachedProbe`); ``default_fps`` is
    ``data.video_fps``, the frame rate of frame lists whose row gives none."""

    def __init__(self, default_fps: float = 2.0):
        self._metas = CachedProbe(lambda ref: _decode(ref, default_fps=default_fps)[0])

    def meta(self, ref: MediaRef, where: Location) -> VideoMeta:
        return self._metas(ref, where)


class VideoProcessor:
    """Frame sampling, resizing and patchification of Qwen2-VL videos (see the module docstring).

    Patch, merge and temporal sizes, and the normalisation constants, are the image processor's:
    a Qwen2.5-VL checkpoint has one vision tower for both.
    """

    def __init__(
        self,
        *,
        fps: float,
        min_frames: int,
        max_frames: int,
        min_pixels: int,
        max_pixels: int,
        total_pixels: int,
        patch_size: int,
        merge_size: int,
        temporal_patch_size: int,
        image_mean,
        image_std,
        rescale_factor: float,
    ):
        self.fps, self.min_frames, self.max_frames = fps, min_frames, max_frames
        self.min_pixels, self.max_pixels, self.total_pixels = min_pixels, max_pixels, total_pixels
        self.patch, self.merge, self.temporal = patch_size, merge_size, temporal_patch_size
        self.mean = np.asarray(image_mean, dtype=np.float32)
        self.std = np.asarray(image_std, dtype=np.float32)
        self.rescale_factor = rescale_factor

    # the transformers class that samples and resizes videos as this rule does, and what it needs
    # to be told (:meth:`hf_settings`): ``qwenkit export`` writes both into the export's
    # ``video_preprocessor_config.json``
    hf_class = "Qwen2VLVideoProcessor"

    @classmethod
    def hf_settings(cls, data, factor: int) -> dict:
        """``data``'s sampling and bounds in the keys of :attr:`hf_class`'s config (``factor``: patch · merge).

        Frames: ``size`` is per frame; 4.57 reads ``min_pixels``/``max_pixels`` instead. The
        per-video total is ``cap_pixels_per_frame`` with ``max_video_tokens``, from which HF
        derives ``int(tokens · factor² · 0.9)`` pixels: the smallest token count whose total
        is at least ``data.video_total_pixels`` (equal when it divides; 4.57 has no total cap).
        """
        tokens = math.ceil(data.video_total_pixels / (factor * factor * 0.9))
        while int(tokens * factor * factor * 0.9) < data.video_total_pixels:  # float rounding of the 0.9
            tokens += 1
        return {
            "size": {"shortest_edge": data.min_pixels, "longest_edge": data.video_max_pixels},
            "min_pixels": data.min_pixels, "max_pixels": data.video_max_pixels,
            "cap_pixels_per_frame": True, "max_video_tokens": tokens, **_sampling(data),
        }  # fmt: skip

    @classmethod
    def from_config(cls, image_processor, data) -> VideoProcessor:
        """``data``'s sampling and pixel bounds, the image processor's patching and constants."""
        return cls(
            fps=data.video_fps,
            min_frames=data.video_min_frames,
            max_frames=data.video_max_frames,
            min_pixels=data.min_pixels,
            max_pixels=data.video_max_pixels,
            total_pixels=data.video_total_pixels,
            patch_size=image_processor.patch_size,
            merge_size=image_processor.merge_size,
            temporal_patch_size=image_processor.temporal_patch_size,
            image_mean=image_processor.image_mean,
            image_std=image_processor.image_std,
            rescale_factor=image_processor.rescale_factor,
        )

    def plan(self, meta: VideoMeta, where: Location, label: str) -> VideoPlan:
        """Which frames, at what size, on what grid: the video's token count before any pixel is read."""
        if meta.frames < self.min_frames:
            raise BadSample(
                where,
                "short_video",
                f"{label} has {meta.frames} frame{'s' if meta.frames != 1 else ''}, fewer than "
                f"data.video_min_frames={self.min_frames}",
            )
        t = self.temporal
        lo = math.ceil(self.min_frames / t) * t
        hi = min(self.max_frames, meta.frames) // t * t
        wanted = meta.frames / meta.fps * self.fps
        n = int(min(max(wanted, lo), hi) // t * t)
        indices = tuple(int(i) for i in np.linspace(0, meta.frames - 1, n).round())
        frame_budget = max(min(self.max_pixels, self.total_pixels * t // n), int(self.min_pixels * 1.05))
        factor = self.patch * self.merge
        try:
            h, w = smart_resize(meta.height, meta.width, factor=factor, min_pixels=self.min_pixels, max_pixels=frame_budget)
        except ValueError as e:  # the processor's own limit: aspect ratio > 200
            raise BadSample(where, "aspect_ratio", f"{label} is {meta.width}x{meta.height} px: {e}") from None
        sample_fps = n / meta.frames * meta.fps
        return VideoPlan(indices, (n // t, h // self.patch, w // self.patch), (h, w), t / sample_fps)

    @staticmethod
    def resized(frames: list[np.ndarray], plan: VideoPlan) -> np.ndarray:
        """``[n, h, w, 3]`` uint8: the sampled RGB frames resized to the plan's size with PIL bicubic (as
        the image processor resizes); what :meth:`pixels` patchifies, and what vLLM is given."""
        rh, rw = plan.size
        return np.stack([np.asarray(Image.fromarray(f).resize((rw, rh), Image.Resampling.BICUBIC)) for f in frames])

    def pixels(self, frames: list[np.ndarray], plan: VideoPlan) -> torch.Tensor:
        """``[t·h·w, C·T·patch²]`` float32 patches of the sampled RGB frames (``[H, W, 3]`` uint8 each);
        a last temporal patch short of frames repeats the last frame (as HF's patchify pads)."""
        resized = self.resized(frames, plan).astype(np.float32)  # [n, H, W, C]
        resized = np.concatenate([resized] + [resized[-1:]] * (-len(resized) % self.temporal))
        resized = (resized * np.float32(self.rescale_factor) - self.mean) / self.std
        t, gh, gw = plan.grid
        m, p, c = self.merge, self.patch, resized.shape[-1]
        x = resized.transpose(0, 3, 1, 2).reshape(t, self.temporal, c, gh // m, m, p, gw // m, m, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, gh/m, gw/m, m, m, C, T, p, p]
        return torch.from_numpy(np.ascontiguousarray(x).reshape(t * gh * gw, c * self.temporal * p * p))

    def frames(self, ref: MediaRef, meta: VideoMeta, where: Location) -> tuple[list[np.ndarray], VideoPlan]:
        """The planned frames of a probed video, RGB ``[H, W, 3]`` uint8 at their original size;
        raises if the file changed since the probe."""
        plan = self.plan(meta, where, ref.label)
        try:
            now, kept = _decode(ref, frozenset(plan.indices), self.fps)
        except Unreadable as e:
            raise e.bad_sample(ref, where) from None
        if now != meta:
            raise BadSample(
                where,
                "changed_media",
                f"{ref.label} now decodes as {now}, but the index measured {meta}: the file changed after the "
                f"index was built; {REBUILD}",
            )
        return [kept[i] for i in plan.indices], plan

    def load(self, ref: MediaRef, meta: VideoMeta, where: Location) -> tuple[torch.Tensor, VideoPlan]:
        """The planned frames of a probed video as patches, and the plan."""
        frames, plan = self.frames(ref, meta, where)
        return self.pixels(frames, plan), plan


class Qwen3VLVideoProcessor(VideoProcessor):
    """Qwen3-VL's frame sampling and resizing, as transformers' ``Qwen3VLVideoProcessor`` with
    ``cap_pixels_per_frame=True`` (qwen-vl-utils' per-frame cap) does them, in qwenkit's units:

    - frames: ``n = int(frames / fps · data.video_fps)`` clamped to ``[video_min_frames,
      video_max_frames]`` and to the frames there are (not rounded to the temporal patch: an odd
      ``n`` repeats its last frame), indices ``linspace(0, frames - 1, n)`` rounded;
    - size: the video's volume ``n·h·w`` within ``[data.min_pixels, n · max(min(video_max_pixels,
      video_total_pixels // n), 1.05 · min_pixels)]`` (HF: ``size.shortest_edge``,
      ``size.longest_edge``, ``max_video_tokens · 32²``), factor ``patch · merge`` = 32;
    - time: each temporal patch's ``timestamps`` entry is the mean time of its first and last frame
      (``index / fps``), which the template writes as ``<t seconds>`` text (HF's
      ``Qwen3VLProcessor._calculate_timestamps``).
    """

    hf_class = "Qwen3VLVideoProcessor"

    @classmethod
    def hf_settings(cls, data, factor: int) -> dict:
        """``size`` bounds the volume ``n·h·w`` (``longest_edge``: the per-video total);
        ``cap_pixels_per_frame`` with ``max_video_tokens = data.video_max_pixels / factor²`` is the
        per-frame share (floored when it does not divide; 4.57 has no cap, and its volume bound is
        the total alone)."""
        return {
            "size": {"shortest_edge": data.min_pixels, "longest_edge": data.video_total_pixels},
            "cap_pixels_per_frame": True, "max_video_tokens": data.video_max_pixels // (factor * factor),
            **_sampling(data),
        }  # fmt: skip

    def plan(self, meta: VideoMeta, where: Location, label: str) -> VideoPlan:
        if meta.frames < self.min_frames:
            return super().plan(meta, where, label)  # the short_video refusal
        t = self.temporal
        n = min(max(int(meta.frames / meta.fps * self.fps), self.min_frames), self.max_frames, meta.frames)
        indices = tuple(int(i) for i in np.linspace(0, meta.frames - 1, n).round())
        factor = self.patch * self.merge
        per_frame = max(min(self.max_pixels, self.total_pixels // n), int(self.min_pixels * 1.05))
        try:
            h, w = _volume_resize(n, meta.height, meta.width, t, factor, self.min_pixels, per_frame * n)
        except ValueError as e:
            raise BadSample(where, "aspect_ratio", f"{label} is {meta.width}x{meta.height} px: {e}") from None
        padded = list(indices) + [indices[-1]] * (-n % t)
        times = tuple((padded[k] + padded[k + t - 1]) / 2 / meta.fps for k in range(0, len(padded), t))
        sample_fps = n / meta.frames * meta.fps
        grid = (len(padded) // t, h // self.patch, w // self.patch)
        return VideoPlan(indices, grid, (h, w), t / sample_fps, times)


def _sampling(data) -> dict:
    return {"fps": data.video_fps, "min_frames": data.video_min_frames, "max_frames": data.video_max_frames,
            "do_sample_frames": True}  # fmt: skip


def _volume_resize(
    frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's video ``smart_resize``: sides on the ``factor`` grid, the bounds on ``frames·h·w``."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# Family.video_rule (the name of transformers' video processor class a rule follows) -> the
# processor that samples and resizes that family's videos
RULES: dict[str, type[VideoProcessor]] = {rule.hf_class: rule for rule in (VideoProcessor, Qwen3VLVideoProcessor)}


def for_processor(processor, data) -> VideoProcessor:
    """The video processor of ``processor``'s family, with ``data``'s sampling and pixel bounds."""
    return RULES[processor.family.video_rule].from_config(processor.image_processor, data)
