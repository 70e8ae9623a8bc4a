"""Bad samples: where a row lives, why it is bad, and the tally a run or ``data check`` reports.

Every problem with a dataset row is raised as a :class:`BadSample` that carries a
:class:`Location` (file, row index, line, id) and one of the :data:`REASONS`, so its message
always reads ``<file>: row <i> ...: <reason>: <detail>`` — enough to open the file and fix it.
Rows count from 0 (as in Python and ``datasets``), lines from 1 (as in editors).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

REASONS = {
    "malformed_json": "the file or line is not valid JSON",
    "bad_format": "the row is not a conversation in a supported layout",
    "bad_role": "a message role other than system, user, assistant or a tool role",
    "turn_order": "turns do not run [system] user assistant user assistant ... (tool responses after a calling reply)",
    "bad_tool": "a tool call without a name or JSON-object arguments, a response with no call before it, a bad 'tools'",
    "no_reply": "the conversation has no assistant reply",
    "empty_reply": "an assistant reply is empty",
    "empty_prompt": "a prompt (train.objective=grpo) has no text and no image or video",
    "image_count": "the number of <image> placeholders differs from the number of images",
    "missing_image": "an image file does not exist",
    "corrupt_image": "an image cannot be decoded (corrupt or truncated)",
    "small_image": "an image side is shorter than data.min_image_side",
    "aspect_ratio": "an image is more elongated than data.max_aspect_ratio",
    "video_count": "the number of <video> placeholders differs from the number of videos",
    "missing_video": "a video file does not exist",
    "corrupt_video": "a video cannot be decoded (corrupt, truncated, no video stream)",
    "short_video": "a video has fewer frames than data.video_min_frames",
    "audio_count": "the number of <audio> placeholders differs from the number of audios",
    "missing_audio": "an audio file does not exist",
    "corrupt_audio": "an audio (or, with data.use_audio_in_video, a video's audio track) cannot be decoded "
    "(corrupt, truncated, no audio stream, a bad data URI)",
    "silent_video": "data.use_audio_in_video: a video has no audio track (HF's positions place a silent video wrongly)",
    "long_audio": "an audio is longer than the feature extractor's 30 s window (it would be cut silently)",
    "no_audio_tower": "a row has audio but the model family has no audio tower",
    "too_long": "the sample has more tokens than data.max_length",
    "media_url": "an image or video is an http(s) URL; URLs are not fetched",
    "changed_media": "an image, video or audio changed after the index was built",
    "same_replies": "a preference pair's chosen and rejected sides are the same (it teaches no preference)",
}

# what a changed_media message tells the user: the index is keyed by the data files, not the media
REBUILD = (
    "rebuild the index: remove it from data.cache_dir (default ~/.cache/qwenkit/data-index) or touch the dataset "
    "file, then run `qwenkit data prepare` (or start training again)"
)


@dataclass(frozen=True)
class Location:
    """Where a row lives. ``row`` is None for problems with a whole file."""

    file: str
    row: int | None = None
    line: int | None = None
    id: str | None = None

    def __str__(self) -> str:
        if self.row is None:
            return self.file if self.line is None else f"{self.file}: line {self.line}"
        extra = []
        if self.line is not None:
            extra.append(f"line {self.line}")
        if self.id is not None:
            extra.append(f"id {self.id!r}")
        return f"{self.file}: row {self.row}" + (f" ({', '.join(extra)})" if extra else "")


class BadSample(ValueError):
    """One bad row (or unreadable file): the location, a key of :data:`REASONS`, and details."""

    def __init__(self, where: Location, reason: str, detail: str):
        if reason not in REASONS:
            raise KeyError(f"unknown bad-sample reason {reason!r}; known: {', '.join(REASONS)}")
        self.where, self.reason, self.detail = where, reason, detail
        super().__init__(f"{where}: {reason}: {detail}")

    def __reduce__(self):  # what a process pool sends back (an exception pickles its message alone)
        return BadSample, (self.where, self.reason, self.detail)


class BadRows(ValueError):
    """More than ``data.max_bad_fraction`` of a dataset's rows are bad: the counts by reason and the first."""


@dataclass
class BadSampleReport:
    """Tally of a dataset scan: rows seen, rows skipped, and why.

    ``messages`` keeps every bad sample's message (one line each) so ``data check`` can list
    them all; training logs only the first few. ``unit``: what is counted, ``samples`` or
    (preference rows, :func:`qwenkit.data.preference.pair_report`) ``pairs``.
    """

    total: int = 0
    skipped: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    unit: str = "samples"

    def add_ok(self) -> None:
        self.total += 1

    def add_bad(self, bad: BadSample) -> None:
        self.total += 1
        self.skipped += 1
        self.by_reason[bad.reason] = self.by_reason.get(bad.reason, 0) + 1
        self.messages.append(str(bad))

    @property
    def fraction(self) -> float:
        return self.skipped / self.total if self.total else 0.0

    def reasons_line(self) -> str:
        return ", ".join(f"{reason} {n}" for reason, n in Counter(self.by_reason).most_common())

    def check_fraction(self, max_bad_fraction: float) -> None:
        """Raise if more than ``max_bad_fraction`` of the rows were skipped."""
        if self.skipped and self.fraction > max_bad_fraction:
            raise BadRows(
                f"{self.skipped} of {self.total} {self.unit} ({self.fraction:.1%}) are bad, more than "
                f"data.max_bad_fraction={max_bad_fraction:g}: {self.reasons_line()}; first: {self.messages[0]}"
            )

    def log(self, first: int = 20) -> None:
        """Log the skipped samples (the first ``first`` one by one) and the counts by reason."""
        one = self.unit.removesuffix("s")
        for message in self.messages[:first]:
            log.warning("skipping bad %s: %s", one, message)
        if len(self.messages) > first:
            log.warning("... and %d more bad %s", len(self.messages) - first, self.unit)
        if self.skipped:
            log.warning(
                "skipped %d of %d %s (%.2f%%): %s",
                self.skipped,
                self.total,
                self.unit,
                100 * self.fraction,
                self.reasons_line(),
            )
