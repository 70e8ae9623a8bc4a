"""``qwenkit data check PATH``: scan a dataset as training would and print what it holds.

Unlike training, the check never stops at the first bad row and never skips silently: it
lists every bad row (file, row, reason) and exits 1 if there is any, 2 if the dataset or the
config cannot be read at all, 0 otherwise. Token counts use the tokenizer and image processor
of ``model.path`` (the tiny one by default; pass ``--config`` for a real checkpoint's).

The check always decodes every image in full (``data.verify_images: full``) and scans afresh;
it then says whether the index cache holds this dataset under the config as training would
use it (``qwenkit data prepare`` builds that index).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections import Counter

import numpy as np

from qwenkit import config as qconfig
from qwenkit.data import cache, layout_survey, open_dataset, read_dataset
from qwenkit.data.dataset import EncodedDataset
from qwenkit.data.layout_readers import REFERENCE_KEYS
from qwenkit.data.load import index_data
from qwenkit.data.preference import PairDataset, pair_layout
from qwenkit.data.reader import DataError
from qwenkit.data.report import REASONS, BadSampleReport
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.paths import load_processor, resolve_path
from qwenkit.model.processor import pixel_bounds

MAX_LISTED = 200  # bad rows printed one by one; the counts by reason are always complete
SYSTEM_SHOWN = 300  # characters of an example's system turn shown on each side of what is left out (a tools block)


def percentiles(values: list[int]) -> dict[str, float]:
    """``min``, ``p50``, ``p90``, ``p99``, ``max`` of token counts (empty for no values)."""
    if not values:
        return {}
    a = np.asarray(values)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"min": int(a.min()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": int(a.max())}


def summarize(dataset: EncodedDataset, report: BadSampleReport, max_length: int) -> str:
    """The check's report as text: counts, token-length distribution, bad samples by reason."""
    good, rows = (len(PairDataset(dataset)), "preference rows") if report.unit == "pairs" else (len(dataset), "rows")
    lines = [
        f"{report.unit}: {good} good, {report.skipped} bad, {report.total} {rows} read",
        f"model family: {dataset.processor.family.name} (its chat template and video sampling)",
    ]
    index = dataset.index
    images, videos, audios = index.kind_mask("image"), index.kind_mask("video"), index.kind_mask("audio")
    lines.append(f"images: {int(images.sum())}")
    if videos.any():
        meta = index.media_meta[videos]  # [n_videos, 4]: frames, fps, width, height
        temporal = dataset.processor.image_processor.temporal_patch_size
        sampled = int(index.media_grid[videos, 0].sum()) * temporal
        lines.append(
            f"videos: {int(videos.sum())}, {(meta[:, 0] / meta[:, 1]).sum():.1f} s, "
            f"{int(meta[:, 0].sum())} frames decoded, {sampled} sampled"
        )
    if audios.any():  # an audio's grid: (mel frames, placeholder tokens, 0); its meta: (samples, rate, 0, 0)
        seconds = (index.media_meta[audios, 0] / index.media_meta[audios, 1]).sum()
        lines.append(f"audios: {int(audios.sum())}, {seconds:.1f} s, {int(index.media_grid[audios, 1].sum())} tokens")
    if len(index):
        lengths = index.length.astype(np.int64)
        p = percentiles(lengths.tolist())
        lines.append(
            f"tokens per sample: min {p['min']}, p50 {p['p50']:.0f}, p90 {p['p90']:.0f}, p99 {p['p99']:.0f}, "
            f"max {p['max']}, mean {lengths.mean():.1f} (data.max_length={max_length})"
        )
        media_tokens = index.media_grid.astype(np.int64).prod(axis=1) // dataset.processor.merge_size**2  # [M]
        video = f"{int(media_tokens[videos].sum())} video, " if videos.any() else ""
        video += f"{int(index.media_grid[audios, 1].sum())} audio, " if audios.any() else ""
        lines.append(
            f"tokens in total: {lengths.sum()} ({int(media_tokens[images].sum())} image, {video}"
            f"{int(index.label_tokens.sum())} learned)"
        )
        truncated = int(index.truncated.sum())
        if truncated:
            lines.append(f"truncated after the last image or video: {truncated}")
    if report.skipped:
        lines.append(f"bad {report.unit} by reason:")
        for reason, n in sorted(report.by_reason.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {reason:<15} {n:>6}  {REASONS[reason]}")
        lines.append(f"bad {report.unit}:")
        lines.extend(f"  {m}" for m in report.messages[:MAX_LISTED])
        if len(report.messages) > MAX_LISTED:
            lines.append(f"  ... and {len(report.messages) - MAX_LISTED} more")
    else:
        lines.append(f"bad {report.unit}: none")
    return "\n".join(lines)


def summarize_pairs(sources) -> str:
    """``train.objective=dpo``: the rows by preference layout. The pairs read, usable (both sides
    passed the scan) and refused (file, row, reason, once per pair) are :func:`summarize`'s lines."""
    layouts_seen: dict[str, int] = {}
    for source in sources:
        inner = source.inner
        for k in range(len(inner)):
            try:
                layout = pair_layout(inner.row(k)) or "none (refused)"
            except Exception:  # noqa: BLE001 - an unreadable row is one of the report's bad samples
                layout = "unreadable (refused)"
            layouts_seen[layout] = layouts_seen.get(layout, 0) + 1
    return "pair layouts: " + ", ".join(f"{name} {n}" for name, n in sorted(layouts_seen.items(), key=lambda kv: (-kv[1], kv[0])))


def summarize_prompts(dataset: EncodedDataset) -> str:
    """``train.objective=grpo``: the usable prompts, by where their reference comes from."""
    columns = {key: 0 for key in REFERENCE_KEYS}
    for i in range(len(dataset)):
        row = dataset.columns(i)
        key = next((k for k in REFERENCE_KEYS if row.get(k) is not None), None)
        if key is not None:
            columns[key] += 1
    from_columns = [f"{n} from '{key}'" for key, n in columns.items() if n]
    replies = len(dataset) - sum(columns.values())
    return f"prompts: {len(dataset)} usable; references: {', '.join([*from_columns, f'{replies} the last assistant reply'])}"


def summarize_tools(dataset: EncodedDataset) -> str:
    """Tool rows (:mod:`qwenkit.data.tool_turns`): how many, the tools they define, their calls and responses, and
    the first one as the model sees it, its learned tokens between ``[[`` and ``]]`` ("" without tool rows)."""
    defined: Counter = Counter()
    rows = calls = replies = responses = 0
    first = None
    for i in range(len(dataset)):
        conv = dataset.conversation(i)
        answered = sum(role == "tool" for role, _ in conv.turns)
        if not (conv.tools or conv.calls or answered):
            continue
        first = i if first is None else first
        rows += 1
        defined.update(t["function"]["name"] for t in conv.tools)
        calls += sum(len(c) for c in conv.calls.values())
        replies, responses = replies + len(conv.calls), responses + answered
    if first is None:
        return ""
    names = ", ".join(f"{name} ({n})" for name, n in defined.most_common()) or "none"
    where = dataset.conversation(first).where
    lines = [f"tool rows: {rows}; tools defined (rows): {names}; {calls} calls in {replies} replies, {responses} "
             "tool responses (never learned)",
             f"tool row example ({where}; learned tokens between [[ ]]):"]  # fmt: skip
    sample = dataset[first]
    return "\n".join(lines + ["  " + line for line in _shown(sample["input_ids"].tolist(), sample["labels"].tolist(),
                                                              dataset.processor.tokenizer).splitlines()])  # fmt: skip


def _shown(ids: list[int], labels: list[int], tokenizer) -> str:
    """A sample's text, its learned runs between ``[[ ]]``, runs of a pad token as one, a long system turn cut."""
    text, run, learned = "", [], False
    for token, label in [*zip(ids, labels), (None, None)]:
        if token is None or (label != IGNORE_INDEX) != learned:
            piece = tokenizer.decode(run)
            text += f"[[{piece}]]" if learned and run else piece
            run, learned = [], label != IGNORE_INDEX
        run.append(token)
    text = re.sub(r"(<\|(?:image|video)_pad\|>)\1+", lambda m: f"{m[1]}x{len(m[0]) // len(m[1])}", text)
    system = re.match(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", text, re.S)
    if system and len(system[1]) > 2 * SYSTEM_SHOWN:
        body = system[1]
        cut = f"{body[:SYSTEM_SHOWN]} ... ({len(body) - 2 * SYSTEM_SHOWN} characters) ... {body[-SYSTEM_SHOWN:]}"
        text = text[: system.start(1)] + cut + text[system.end(1) :]
    return text


def check(cfg: qconfig.Config) -> int:
    """``qwenkit data check``: scan ``cfg.data.path`` with ``cfg.model``'s processor and print a summary.

    Returns the command's exit status: 0 all good, 1 bad samples, 2 unreadable data or model.
    """
    try:
        model_dir = resolve_path(cfg.model)
        processor = load_processor(cfg, model_dir)
        full = dataclasses.replace(cfg.data, verify_images="full")
        reads = qconfig.OBJECTIVES[cfg.train.objective].reads  # pairs: each preference row read as two SFT rows
        dataset, report = read_dataset(full, processor, stop_at_first=False, use_cache=False, reads=reads)
        sources = open_dataset(cfg.data, reads=reads)
        cache_line = cache.status(sources, processor, index_data(cfg.data, reads), prompts=reads == "prompts")
        layout_lines = summarize_pairs(sources) if reads == "pairs" else layout_survey.describe(sources, cfg.data.layout)
        if reads == "prompts":
            layout_lines += "\n" + summarize_prompts(dataset)
    except (DataError, FileNotFoundError) as e:
        print(f"qwenkit data check: {e}", file=sys.stderr)
        return 2
    lo, hi = pixel_bounds(processor.image_processor)
    print(f"dataset: {cfg.data.path}")
    d = cfg.data
    print(f"processor: {model_dir} (model.path={cfg.model.path}), images resized to {lo}..{hi} pixels")
    print(
        f"video sampling: {d.video_fps:g} fps, {d.video_min_frames}..{d.video_max_frames} frames, frames within "
        f"{d.min_pixels}..{d.video_max_pixels} pixels and {d.video_total_pixels} per video"
    )
    print(layout_lines)
    print(summarize(dataset, report, cfg.data.max_length))
    if tools := summarize_tools(dataset):
        print(tools)
    print(cache_line)
    if report.skipped:
        print(f"FAILED: {report.skipped} bad {report.unit if report.skipped != 1 else report.unit.removesuffix('s')}")
        return 1
    print("OK")
    return 0
