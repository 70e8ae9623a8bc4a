"""The scan of every row into a :class:`~qwenkit.data.index.SampleIndex`, and the lazily
encoded dataset of the rows that passed.

:func:`scan_rows` reads a range of rows: conversation checks, every image measured and checked
(``data.verify_images``: header and end marker, or a full decode), and the token count computed
from the predicted image grids. :func:`scan_parallel` splits a range over ``data.num_proc``
forked processes; :mod:`qwenkit.data.cache` splits the rows over ranks and keeps the result.
So the report, the length distribution and the ``max_bad_fraction`` check all exist before
training starts.

:class:`EncodedDataset` encodes a sample when it is indexed (pixels are large: a dataset's
worth would not fit in memory) and checks that the image processor's grids equal the scan's
prediction, so the token count the scan promised is the one the model sees. A sample that
turns out bad only when loaded (an image corrupt inside its compressed data, which a header
check cannot see) follows ``data.on_bad_sample``: ``error`` raises it, naming file and row;
``skip`` logs it and hands out the next good sample in dataset order instead. The stand-in
depends only on the index, so every rank makes the same choice for the same sample and every
rank still gets a full micro-batch: no rank waits in a collective for one that skipped.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from qwenkit.config import DataConfig
from qwenkit.data import audio
from qwenkit.data.conversation import Conversation, parse_row
from qwenkit.data.images import ImageProbe, MediaRef, load, predict_grid, resolve
from qwenkit.data.index import MEDIA_KINDS, BadRecord, SampleIndex, SampleInfo, empty_columns, to_index
from qwenkit.data.reader import HFSource, JsonSource
from qwenkit.data.report import REBUILD, BadSample
from qwenkit.data.template import ChatTemplate, fit_length
from qwenkit.data.video import VideoMeta, VideoPlan, VideoProbe, VideoProcessor, for_processor
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.processor import Processor, needs_mm_token_type_ids

log = logging.getLogger(__name__)

Source = JsonSource | HFSource


class SampleView(Sequence):
    """``dataset.samples[i]``: a :class:`SampleInfo` made from the index on access."""

    def __init__(self, index: SampleIndex):
        self.index = index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> SampleInfo:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.index.info(i % len(self))


class EncodedDataset:
    """Good samples, encoded on access: ``dataset[i]`` is one sample's model inputs.

    A sample dict holds ``input_ids [S]``, ``labels [S]`` (``-100`` ignored), and, when it has
    images, ``pixel_values [P, C*T*patch²]`` and ``image_grid_thw [n_images, 3]``; when it has
    videos, ``pixel_values_videos [P', C*T*patch²]``, ``video_grid_thw [n_videos, 3]`` and
    ``second_per_grid_ts [n_videos]``; ``mm_token_type_ids [S]`` (1 on image pad tokens, 2 on
    video pad tokens) where transformers needs it; ``num_bad``
    (a scalar) only when bad samples were skipped to reach it (``data.on_bad_sample: skip``).
    ``index_origin`` says where the index came from (see :mod:`qwenkit.data.cache`).
    """

    def __init__(
        self,
        sources: list[Source],
        index: SampleIndex,
        processor: Processor,
        data: DataConfig,
        origin: str = "scanned",
        prompts: bool = False,  # rows may be prompts whose reference is a column (GRPO's, see parse_row)
    ):
        self.sources, self.index, self.processor, self.data, self.prompts = sources, index, processor, data, prompts
        self.template = ChatTemplate(processor, data.system_prompt, data.use_audio_in_video)
        self.video_processor = for_processor(processor, data)
        self.with_mm_token_type_ids = needs_mm_token_type_ids()
        self.samples = SampleView(index)
        self.index_origin = origin

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per good sample, ``[N]`` int32: the index's own column, no copy."""
        return self.index.length

    @property
    def has_videos(self) -> bool:
        """Whether any good sample has a video (every rank then runs the vision tower twice a step)."""
        return self.index.has_videos

    def conversation(self, i: int) -> Conversation:
        source = self.sources[int(self.index.source[i])]
        row = int(self.index.row[i])
        return parse_row(source.row(row), source.location(row), self.data.layout, self.prompts)

    def columns(self, i: int) -> dict:
        """Sample ``i``'s row as read (its columns: ``messages``, ``images``, a ``solution``...; GRPO's rewards get them)."""
        row = self.sources[int(self.index.source[i])].row(int(self.index.row[i]))
        return dict(row) if isinstance(row, dict) else {}

    def image_refs(self, i: int, conv: Conversation | None = None) -> list[MediaRef]:
        """Where sample ``i``'s images are (``conv``: its conversation, read when not given)."""
        conv = self.conversation(i) if conv is None else conv
        base = self.sources[int(self.index.source[i])].base_dir
        return resolve(conv.images, conv.where, base, self.data.image_dir)

    def subset(self, indices: list[int]) -> EncodedDataset:
        """The samples at ``indices`` (in that order), sharing sources and processor."""
        return EncodedDataset(
            self.sources, self.index.take(indices), self.processor, self.data, self.index_origin, self.prompts
        )

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        for k in range(n):
            try:
                sample = self.encode((i + k) % n)
            except BadSample as bad:
                if self.data.on_bad_sample == "error":
                    raise
                log.warning("skipping bad sample met while loading: %s", bad)
                continue
            if k:
                sample["num_bad"] = torch.tensor(k)
            return sample
        raise ValueError(f"every one of the {n} samples failed to load; see the warnings above")

    def encode(self, i: int, media: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Sample ``i`` as model inputs; raises :class:`BadSample` when its images or videos fail to load.

        ``media``: its image/video tensors when already processed (a preference pair's second side).
        """
        conv = self.conversation(i)
        sample = dict(media) if media is not None else self._media(i, conv)
        times, seconds = self._video_plans(i, conv)
        enc = fit_length(
            self.template.encode(conv, self.index.grids(i), self.index.grids(i, "video"), times, self._audio_tokens(i),
                                 seconds),  # fmt: skip
            conv,
            self.data.max_length,
            self.data.truncate_text,
        )
        input_ids = torch.tensor(enc.input_ids, dtype=torch.long)  # [S]
        sample["input_ids"] = input_ids
        sample["labels"] = torch.tensor(enc.labels, dtype=torch.long)  # [S]
        if self.with_mm_token_type_ids:
            sample["mm_token_type_ids"] = self._token_types(input_ids)  # [S]
        return sample

    def prompt(self, i: int,
               edit: Callable[[Conversation], Conversation] | None = None) -> tuple[dict[str, torch.Tensor], Conversation]:
        """Generation inputs of sample ``i``: every turn before its last reply (a prompt-only row: every
        turn), then the assistant header; ``edit``: a change of those turns' text before they are encoded (its
        media kept), as agentic rollouts put their tools in the system turn (:mod:`qwenkit.engine.rollouts.agentic`).

        Returns ``(inputs, conversation)``; ``inputs`` holds ``input_ids [1, S]``,
        ``attention_mask [1, S]``, the pixels and grids of every image and video, and
        ``mm_token_type_ids [1, S]`` where transformers needs it. The reference answer is
        ``conversation.reference`` (:mod:`qwenkit.data.conversation`).
        """
        conv = self.conversation(i)
        asked = dataclasses.replace(conv, turns=conv.turns[:-1] if conv.turns[-1][0] == "assistant" else conv.turns)
        asked = edit(asked) if edit is not None else asked
        times, seconds = self._video_plans(i, conv)
        encoded = self.template.encode(asked, self.index.grids(i), self.index.grids(i, "video"), times,
                                       self._audio_tokens(i), seconds)  # fmt: skip
        inputs = self._media(i, conv)
        input_ids = torch.tensor([encoded.input_ids + self.template.headers["assistant"]], dtype=torch.long)  # [1, S]
        inputs["input_ids"] = input_ids
        inputs["attention_mask"] = torch.ones_like(input_ids)
        if self.with_mm_token_type_ids:
            inputs["mm_token_type_ids"] = self._token_types(input_ids)  # [1, S]
        return inputs, conv

    def _video_plans(self, i: int, conv: Conversation) -> tuple[list[tuple[float, ...]], list[float]]:
        """Each video's temporal-patch times and seconds per temporal patch, planned again from the index's
        metadata (no decoding), as far as the template reads them (``([], [])`` otherwise)."""
        if not (self.template.video_timestamps or self.template.audio_in_video):
            return [], []
        refs = self.video_refs(i, conv)
        plans = [self.video_processor.plan(m, conv.where, r.label) for r, m in zip(refs, self.index.videos(i))]
        return [p.timestamps for p in plans], [p.second_per_grid for p in plans]

    def _audio_tokens(self, i: int) -> list[int]:
        """Each heard audio's placeholder count (:func:`qwenkit.data.audio.heard`'s order), as the scan computed
        it (the index's audio grids hold it)."""
        return [tokens for _, tokens, _ in self.index.grids(i, "audio")]

    def _token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """transformers 5.x's ``mm_token_type_ids``: 0 text, 1 image pad, 2 video pad."""
        return (input_ids == self.processor.image_token_id).long() + 2 * (
            input_ids == self.processor.video_token_id
        ).long()

    def _media(self, i: int, conv: Conversation) -> dict[str, torch.Tensor]:
        """Sample ``i``'s image and video tensors, checked against the scan's grids."""
        grids_of = self.index.grids(i)
        refs = self.image_refs(i, conv)
        sample: dict[str, torch.Tensor] = {}
        if refs:
            images = [load(ref, conv.where) for ref in refs]
            pixels = self.processor.image_processor(images=images, return_tensors="pt")
            grids = [tuple(int(x) for x in g) for g in pixels["image_grid_thw"]]
            if grids != grids_of:
                raise BadSample(
                    conv.where,
                    "changed_media",
                    f"the image processor made grids {grids} but the index predicted {grids_of}: an image changed "
                    f"after the index was built; {REBUILD}",
                )
            sample["pixel_values"] = pixels["pixel_values"]  # [P, C*T*patch²]
            sample["image_grid_thw"] = pixels["image_grid_thw"].long()  # [n_images, 3]
        if self.index.grids(i, "video"):
            sample.update(self._videos(conv, self.video_refs(i, conv), self.index.videos(i)))
        frames = [f for f, _, _ in self.index.grids(i, "audio")]  # the <audio> entries and the heard video tracks
        if frames:  # input_features [n_audio, 128, F], feature_attention_mask [n_audio, F]
            base = self.sources[int(self.index.source[i])].base_dir
            tracks = self.video_refs(i, conv) if self.data.use_audio_in_video else None
            sample.update(audio.load(conv, base, frames, self.processor.family, tracks))
        return sample

    def video_refs(self, i: int, conv: Conversation) -> list[MediaRef]:
        """Where sample ``i``'s videos are (``conv`` is its conversation)."""
        base = self.sources[int(self.index.source[i])].base_dir
        return resolve(conv.videos, conv.where, base, self.data.video_dir or self.data.image_dir, kind="video")

    def _videos(self, conv: Conversation, refs: list[MediaRef], metas: list[VideoMeta]) -> dict[str, torch.Tensor]:
        pixels, grids, seconds = [], [], []
        for ref, meta in zip(refs, metas):
            patches, plan = self.video_processor.load(ref, meta, conv.where)
            pixels.append(patches)
            grids.append(plan.grid)
            seconds.append(plan.second_per_grid)
        out = {
            "pixel_values_videos": torch.cat(pixels),  # [P', C*T*patch²]
            "video_grid_thw": torch.tensor(grids, dtype=torch.long),  # [n_videos, 3]
        }
        if not self.template.video_timestamps:  # Qwen3-VL's time is the timestamp text, not an mRoPE step
            out["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)  # [n_videos]
        return out


# ---------------------------------------------------------------------------------------------
# The scan


def row_ranges(sources: list[Source]) -> np.ndarray:
    """``starts [len(sources) + 1]``: source ``s`` holds global rows ``starts[s]:starts[s+1]``."""
    return np.concatenate([[0], np.cumsum([len(s) for s in sources])]).astype(np.int64)


def scan_rows(
    sources: list[Source], processor: Processor, data: DataConfig, lo: int, hi: int, full: bool, prompts: bool = False
) -> SampleIndex:
    """Check global rows ``lo:hi``; an unreadable file has no rows (the caller records it).

    ``prompts``: a row may be a prompt whose reference is a column (GRPO's rows, see :func:`parse_row`)."""
    template = ChatTemplate(processor, data.system_prompt, data.use_audio_in_video)
    probe = ImageProbe(data.min_image_side, data.max_aspect_ratio, full)
    videos = _VideoScan(VideoProbe(data.video_fps), for_processor(processor, data), data)
    starts = row_ranges(sources)
    cols, bad, total = empty_columns(), [], 0
    for s, source in enumerate(sources):
        a, b = max(lo, starts[s]), min(hi, starts[s + 1])
        for r in range(a - starts[s], b - starts[s]):
            total += 1
            try:
                length, grids, learned, truncated, metas, video_grids, audios = _scan_row(
                    source, r, template, probe, videos, data, prompts
                )
            except BadSample as e:
                bad.append(BadRecord.of(s, e))
                continue
            for name, value in zip(
                ("source", "row", "length", "label_tokens", "truncated"), (s, r, length, learned, truncated)
            ):
                cols[name].append(value)
            cols["media_count"].append(len(grids) + len(video_grids) + len(audios))
            cols["media_kind"].extend([MEDIA_KINDS["image"]] * len(grids) + [MEDIA_KINDS["video"]] * len(video_grids))
            cols["media_kind"].extend([MEDIA_KINDS["audio"]] * len(audios))
            cols["media_grid"].extend(grids + video_grids + [(frames, tokens, 0) for frames, tokens, _ in audios])
            cols["media_meta"].extend([(0.0, 0.0, 0.0, 0.0)] * len(grids))
            cols["media_meta"].extend((m.frames, m.fps, m.width, m.height) for m in metas)
            cols["media_meta"].extend((samples, audio.SAMPLE_RATE, 0.0, 0.0) for _, _, samples in audios)
    return to_index(cols, bad, total)


def _scan_row(
    source: Source, r: int, template: ChatTemplate, probe: ImageProbe, videos: _VideoScan, data: DataConfig,
    prompts: bool,
):
    conv = parse_row(source.row(r), source.location(r), data.layout, prompts)
    grids = []
    for ref in resolve(conv.images, conv.where, source.base_dir, data.image_dir):
        size = probe.size(ref, conv.where)
        try:
            grids.append(predict_grid(size, template.processor.image_processor))
        except ValueError as e:  # the processor's own limits (e.g. aspect ratio > 200)
            raise BadSample(conv.where, "aspect_ratio", f"{ref.label}: {e}") from None
    refs, metas, plans = videos.measure(conv, source.base_dir)
    video_grids = [p.grid for p in plans]
    tracks = refs if data.use_audio_in_video else None  # each video's own audio, heard in placeholder order
    audios = audio.measure(conv, source.base_dir, template.processor.family, tracks)  # [(frames, tokens, samples)]
    enc = fit_length(
        template.encode(conv, grids, video_grids, [p.timestamps for p in plans], [t for _, t, _ in audios],
                        [p.second_per_grid for p in plans]),
        conv, data.max_length, data.truncate_text,
    )  # fmt: skip
    learned = sum(label != IGNORE_INDEX for label in enc.labels[1:])
    return len(enc.input_ids), grids, learned, enc.truncated_from is not None, metas, video_grids, audios


class _VideoScan:
    """The scan's video step: probe each clip (cached), then predict its grid from the metadata."""

    def __init__(self, probe: VideoProbe, processor: VideoProcessor, data: DataConfig):
        self.probe, self.processor, self.base = probe, processor, data.video_dir or data.image_dir

    def measure(self, conv: Conversation, base_dir) -> tuple[list[MediaRef], list[VideoMeta], list[VideoPlan]]:
        refs, metas, plans = resolve(conv.videos, conv.where, base_dir, self.base, kind="video"), [], []
        for ref in refs:
            meta = self.probe.meta(ref, conv.where)
            metas.append(meta)
            plans.append(self.processor.plan(meta, conv.where, ref.label))
        return refs, metas, plans


# what forked scan processes read: set just before the fork, so nothing is pickled but row ranges
_FORKED: tuple | None = None


def _scan_forked(bounds: tuple[int, int]) -> SampleIndex:
    sources, processor, data, full, prompts = _FORKED
    return scan_rows(sources, processor, data, bounds[0], bounds[1], full, prompts)


def scan_parallel(
    sources: list[Source],
    processor: Processor,
    data: DataConfig,
    lo: int,
    hi: int,
    full: bool,
    num_proc: int,
    progress: bool = False,
    prompts: bool = False,
) -> SampleIndex:
    """:func:`scan_rows` over ``lo:hi`` with ``num_proc`` processes (forked: the row spans and
    the processor are shared copy-on-write, not pickled; each process reads its own rows from
    the files); pieces come back in row order. ``progress``: a bar over the rows on stderr."""
    forked = num_proc > 1 and hi - lo >= 2 * num_proc
    # a few pieces per process balance the load; a bar wants more, each a small share of the rows
    count = (4 * num_proc if forked else 1) if not progress else max(4 * num_proc, min(256, (hi - lo) // 500), 1)
    edges = np.linspace(lo, hi, count + 1).astype(np.int64)
    pieces = list(zip(edges[:-1].tolist(), edges[1:].tolist()))
    with tqdm(total=hi - lo, unit="rows", desc="scan", disable=not progress) as bar:
        if not forked:
            return SampleIndex.concat(
                [_done(scan_rows(sources, processor, data, a, b, full, prompts), b - a, bar) for a, b in pieces]
            )
        for source in sources:
            source.find_rows()  # once, before the fork, so no child does it again
        global _FORKED
        _FORKED = (sources, processor, data, full, prompts)
        try:
            with multiprocessing.get_context("fork").Pool(num_proc) as pool:
                done = pool.imap(_scan_forked, pieces, chunksize=1)
                return SampleIndex.concat([_done(piece, b - a, bar) for (a, b), piece in zip(pieces, done)])
        finally:
            _FORKED = None


def _done(piece: SampleIndex, rows: int, bar: tqdm) -> SampleIndex:
    bar.update(rows)
    return piece
