"""The build-time scan of every row, and the lazily encoded dataset of the rows that passed.

:func:`scan` reads every row once: conversation checks, every image and video decoded in full
(so a truncated file shows now, not at step 9,000) and measured, and the token count computed
from the predicted image and video grids. It keeps a small :class:`SampleInfo` per good row, so the report,
the length distribution and the ``max_bad_fraction`` check all exist before training starts.

:class:`EncodedDataset` encodes a sample when it is indexed (pixels are large: a dataset's
worth would not fit in memory) and checks that the image processor's grids equal the scan's
prediction, so the token count the scan promised is the one the model sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qwenkit.config import DataConfig
from qwenkit.data.conversation import Conversation, parse_row
from qwenkit.data.images import ImageProbe, ImageRef, load, predict_grid, resolve
from qwenkit.data.reader import HFSource, JsonSource
from qwenkit.data.report import BadSample, BadSampleReport
from qwenkit.data.template import Qwen2VLTemplate, fit_length
from qwenkit.data.video import VideoMeta, VideoProbe, VideoProcessor
from qwenkit.loss import IGNORE_INDEX
from qwenkit.processor import Processor, needs_mm_token_type_ids


@dataclass(slots=True)
class SampleInfo:
    """What the scan learned about one good row."""

    source: int  # index into the dataset's sources
    row: int
    length: int  # tokens, images included, after data.max_length
    grids: list[tuple[int, int, int]]
    label_tokens: int  # learned tokens (assistant replies and their <|im_end|>)
    truncated: bool
    videos: list[VideoMeta]  # what the probe measured; the plan (frames, grid) follows from it
    video_grids: list[tuple[int, int, int]]


class EncodedDataset:
    """Good samples, encoded on access: ``dataset[i]`` is one sample's model inputs.

    A sample dict holds ``input_ids [S]``, ``labels [S]`` (``-100`` ignored), and, when it has
    images, ``pixel_values [P, C*T*patch²]`` and ``image_grid_thw [n_images, 3]``; when it has
    videos, ``pixel_values_videos [P', C*T*patch²]``, ``video_grid_thw [n_videos, 3]`` and
    ``second_per_grid_ts [n_videos]``; ``mm_token_type_ids [S]`` (1 on image pad tokens, 2 on
    video pad tokens) where transformers needs it.
    """

    def __init__(
        self,
        sources: list[JsonSource | HFSource],
        samples: list[SampleInfo],
        processor: Processor,
        data: DataConfig,
    ):
        self.sources, self.samples, self.processor, self.data = sources, samples, processor, data
        self.template = Qwen2VLTemplate(processor, data.system_prompt)
        self.video_processor = VideoProcessor.from_config(processor.image_processor, data)
        self.with_mm_token_type_ids = needs_mm_token_type_ids()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def has_videos(self) -> bool:
        """Whether any good sample has a video (every rank then runs the vision tower twice a step)."""
        return any(s.videos for s in self.samples)

    def conversation(self, i: int) -> Conversation:
        info = self.samples[i]
        source = self.sources[info.source]
        return parse_row(source.row(info.row), source.location(info.row))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        info = self.samples[i]
        conv = self.conversation(i)
        refs = resolve(conv.images, conv.where, self.sources[info.source].base_dir, self.data.image_dir)
        sample: dict[str, torch.Tensor] = {}
        if refs:
            images = [load(ref, conv.where) for ref in refs]
            pixels = self.processor.image_processor(images=images, return_tensors="pt")
            grids = [tuple(int(x) for x in g) for g in pixels["image_grid_thw"]]
            if grids != info.grids:
                raise RuntimeError(
                    f"{conv.where}: the image processor made grids {grids} but the scan predicted {info.grids}; "
                    "were the images changed after the dataset was built?"
                )
            sample["pixel_values"] = pixels["pixel_values"]  # [P, C*T*patch²]
            sample["image_grid_thw"] = pixels["image_grid_thw"].long()  # [n_images, 3]
        if info.videos:
            sample.update(self._videos(conv, info))
        enc = fit_length(
            self.template.encode(conv, info.grids, info.video_grids),
            conv,
            self.data.max_length,
            self.data.truncate_text,
        )
        input_ids = torch.tensor(enc.input_ids, dtype=torch.long)  # [S]
        sample["input_ids"] = input_ids
        sample["labels"] = torch.tensor(enc.labels, dtype=torch.long)  # [S]
        if self.with_mm_token_type_ids:
            sample["mm_token_type_ids"] = (
                (input_ids == self.processor.image_token_id).long()
                + 2 * (input_ids == self.processor.video_token_id).long()
            )  # [S]
        return sample

    def video_refs(self, conv: Conversation, info: SampleInfo) -> list[ImageRef]:
        base = self.sources[info.source].base_dir
        return resolve(conv.videos, conv.where, base, self.data.video_dir or self.data.image_dir, kind="video")

    def _videos(self, conv: Conversation, info: SampleInfo) -> dict[str, torch.Tensor]:
        pixels, grids, seconds = [], [], []
        for ref, meta in zip(self.video_refs(conv, info), info.videos):
            patches, plan = self.video_processor.load(ref, meta, conv.where)
            pixels.append(patches)
            grids.append(plan.grid)
            seconds.append(plan.second_per_grid)
        return {
            "pixel_values_videos": torch.cat(pixels),  # [P', C*T*patch²]
            "video_grid_thw": torch.tensor(grids, dtype=torch.long),  # [n_videos, 3]
            "second_per_grid_ts": torch.tensor(seconds, dtype=torch.float32),  # [n_videos]
        }


def scan(
    sources: list[JsonSource | HFSource], processor: Processor, data: DataConfig, stop_at_first: bool
) -> tuple[EncodedDataset, BadSampleReport]:
    """Check every row; ``stop_at_first`` raises the first :class:`BadSample`, else all are counted."""
    template = Qwen2VLTemplate(processor, data.system_prompt)
    probe = ImageProbe(data.min_image_side, data.max_aspect_ratio)
    videos = _VideoScan(VideoProbe(), VideoProcessor.from_config(processor.image_processor, data), data)
    report = BadSampleReport()
    samples: list[SampleInfo] = []
    for s, source in enumerate(sources):
        if source.error is not None:  # the whole file is unreadable; it has no rows
            if stop_at_first:
                raise source.error
            report.add_bad(source.error)
        for r in range(len(source)):
            try:
                samples.append(_scan_row(source, s, r, template, probe, videos, data))
            except BadSample as bad:
                if stop_at_first:
                    raise
                report.add_bad(bad)
            else:
                report.add_ok()
    return EncodedDataset(sources, samples, processor, data), report


def _scan_row(
    source, s: int, r: int, template: Qwen2VLTemplate, probe: ImageProbe, videos: _VideoScan, data: DataConfig
) -> SampleInfo:
    conv = parse_row(source.row(r), source.location(r))
    grids = []
    for ref in resolve(conv.images, conv.where, source.base_dir, data.image_dir):
        size = probe.size(ref, conv.where)
        try:
            grids.append(predict_grid(size, template.processor.image_processor))
        except ValueError as e:  # the processor's own limits (e.g. aspect ratio > 200)
            raise BadSample(conv.where, "aspect_ratio", f"{ref.label}: {e}") from None
    metas, video_grids = videos.measure(conv, source.base_dir)
    enc = fit_length(template.encode(conv, grids, video_grids), conv, data.max_length, data.truncate_text)
    learned = sum(label != IGNORE_INDEX for label in enc.labels[1:])
    return SampleInfo(
        s, r, len(enc.input_ids), grids, learned, enc.truncated_from is not None, metas, video_grids
    )


class _VideoScan:
    """The scan's video step: probe each clip (cached), then predict its grid from the metadata."""

    def __init__(self, probe: VideoProbe, processor: VideoProcessor, data: DataConfig):
        self.probe, self.processor, self.base = probe, processor, data.video_dir or data.image_dir

    def measure(self, conv: Conversation, base_dir) -> tuple[list[VideoMeta], list[tuple[int, int, int]]]:
        metas, grids = [], []
        for ref in resolve(conv.videos, conv.where, base_dir, self.base, kind="video"):
            meta = self.probe.meta(ref, conv.where)
            metas.append(meta)
            grids.append(self.processor.plan(meta, conv.where, ref.label).grid)
        return metas, grids
