"""A dataset as the model will see it, for notebook 01: distributions and rendered samples.

:func:`render_sample` shows one encoded sample as HTML: its images and a few of each video's
sampled frames (thumbnails embedded as PNG data URIs, so a report stays one file) and its
templated token stream, token runs coloured by what they are: **learned** (labels kept:
assistant replies and their ``<|im_end|>``), context (ignored by the loss), special tokens, and
image / video / audio spans collapsed to one chip each with its token count. Each audio is an HTML
``<audio>`` player (the decoded 16 kHz wave as an embedded WAV data URI) with its length and token count.
The colouring comes from the sample's ``labels`` tensor, i.e. from exactly what training uses.
"""

from __future__ import annotations

import base64
import html
import io
import wave
from typing import Any

import numpy as np
import torch

from qwenkit.data import REASONS, FixedSizeSampler
from qwenkit.data import audio as qaudio
from qwenkit.data.check import percentiles
from qwenkit.data.images import load, resolve
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.processor import SPECIAL_TOKENS, Processor
from qwenkit.notebooks import plots, results

SUMMARY_FILE = "data_summary.csv"
BAD_LISTED = 50  # bad-sample messages kept in the result file and shown in the report
STYLE = {
    "learned": "background:#c8f7c5;border-bottom:2px solid #1a7f37",
    "context": "",
    "special": "color:#8250df;font-weight:600",
    "image": "background:#ddf4ff;border:1px solid #54aeff;border-radius:3px;padding:0 3px;color:#0969da",
    "video": "background:#fff1e5;border:1px solid #fb8f44;border-radius:3px;padding:0 3px;color:#bc4c00",
    "audio": "background:#fbefff;border:1px solid #c297ff;border-radius:3px;padding:0 3px;color:#8250df",
}
MEDIA = ("image", "video", "audio")  # the kinds a sample's token stream shows as one chip per span
FRAMES_SHOWN = 4  # sampled frames rendered per video, spread over the clip


# ---------------------------------------------------------------------------------------------
# Distributions


def distributions(dataset) -> dict[str, list[int]]:
    """Per good sample: total tokens, image tokens, video tokens, audio tokens, learned tokens, images,
    videos, audios (from the index arrays; an audio item's grid holds its tokens second)."""
    index = dataset.index
    per_item = index.media_grid.astype(np.int64).prod(axis=1) // dataset.processor.merge_size**2  # [M]
    audios = index.kind_mask("audio")
    per_item[audios] = index.media_grid[audios, 1]
    row_of_item = np.repeat(np.arange(len(index)), index.media_per_row)  # [M]

    def per_row(kind: str, weights: np.ndarray) -> list[int]:
        mask = index.kind_mask(kind)
        return np.bincount(row_of_item[mask], weights=weights[mask], minlength=len(index)).astype(np.int64).tolist()

    ones = np.ones(len(per_item))
    return {
        "tokens": index.length.tolist(),
        "image_tokens": per_row("image", per_item),
        "video_tokens": per_row("video", per_item),
        "audio_tokens": per_row("audio", per_item),
        "learned_tokens": index.label_tokens.tolist(),
        "images": per_row("image", ones),
        "videos": per_row("video", ones),
        "audios": per_row("audio", ones),
    }


def padding(lengths: list[int], micro_batch_size: int, seed: int) -> list[dict[str, Any]]:
    """Padding of one epoch at ``micro_batch_size``, padded (as the training sampler groups the
    samples) and packed (``data.packing``): rows of layout, micro-batches, positions, pad fraction."""
    batches = FixedSizeSampler(len(lengths), micro_batch_size, seed).epoch_batches(0)
    real = sum(lengths[i] for b in batches for i in b)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return [
        {"layout": f"padded, {micro_batch_size} per micro-batch", "micro-batches": len(batches),
         "positions": padded, "padding fraction": 1 - real / padded},
        {"layout": "packed (data.packing: true)", "micro-batches": len(batches),
         "positions": real, "padding fraction": 0.0},
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# One sample as HTML


def segments(input_ids: list[int], labels: list[int], processor: Processor) -> list[tuple[str, str]]:
    """``(kind, text)`` runs of one sample: kind in learned / context / special / image / video / audio.

    Consecutive tokens of one kind are decoded together, so a character split over several
    byte-level tokens (CJK text) comes out whole. An image (video) span's pad tokens become one
    ``image`` (``video``) run whose text is the token count.
    """
    tok = processor.tokenizer
    special = {tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS} | set(processor.audio_ids)
    audio_pad = processor.audio_ids[1] if processor.audio_ids else None

    def kind(i: int) -> str:
        if input_ids[i] == processor.image_token_id:
            return "image"
        if input_ids[i] == processor.video_token_id:
            return "video"
        if input_ids[i] == audio_pad:
            return "audio"
        if labels[i] != IGNORE_INDEX:
            return "learned"
        return "special" if input_ids[i] in special else "context"

    runs: list[tuple[str, list[int]]] = []
    for i, t in enumerate(input_ids):
        k = kind(i)
        # special tokens each stand alone, so <|im_end|> after a reply stays visible as a token
        if runs and runs[-1][0] == k and k != "special":
            runs[-1][1].append(t)
        else:
            runs.append((k, [t]))
    out = []
    for k, ids in runs:
        text = f"{len(ids)}" if k in MEDIA else tok.decode(ids, skip_special_tokens=False)
        out.append((k, text))
    return out


def thumbnail(image, side: int = 160) -> str:
    image = image.convert("RGB").copy()
    image.thumbnail((side, side))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def sample_images(dataset, i: int) -> list:
    """The PIL images of good sample ``i``, in placeholder order."""
    info = dataset.samples[i]
    conv = dataset.conversation(i)
    refs = resolve(conv.images, conv.where, dataset.sources[info.source].base_dir, dataset.data.image_dir)
    return [load(ref, conv.where) for ref in refs]


def sample_videos(dataset, i: int) -> list[tuple[list, Any, Any]]:
    """Per video of good sample ``i``: its sampled frames as PIL images, its ``VideoPlan`` and ``VideoMeta``."""
    from PIL import Image

    info = dataset.samples[i]
    conv = dataset.conversation(i)
    out = []
    for ref, meta in zip(dataset.video_refs(i, conv), info.videos):
        frames, plan = dataset.video_processor.frames(ref, meta, conv.where)
        out.append(([Image.fromarray(f) for f in frames], plan, meta))
    return out


def _video_strip(k: int, frames: list, plan, meta, processor: Processor) -> str:
    """A few of one video's sampled frames, with the seconds they stand at and the token count."""
    shown = sorted({round(j) for j in np.linspace(0, len(frames) - 1, min(FRAMES_SHOWN, len(frames)))})
    thumbs = "".join(
        f'<figure style="display:inline-block;margin:4px;text-align:center">'
        f'<img src="{thumbnail(frames[j], 120)}" style="border:1px solid #ccc;max-height:120px">'
        f'<figcaption style="font-size:11px;color:#666">frame {plan.indices[j]} · {plan.indices[j] / meta.fps:.1f} s</figcaption></figure>'
        for j in shown
    )
    t, h, w = plan.grid
    caption = (
        f"video {k}: {len(frames)} of {meta.frames} frames ({meta.frames / meta.fps:.1f} s) sampled, resized to {plan.size[1]}x{plan.size[0]} px, "
        f"grid {plan.grid}, {processor.image_tokens(plan.grid)} tokens ({t} x {h * w // processor.merge_size**2})"
    )
    return f'<div style="{STYLE["video"]};display:inline-block;margin:4px">{html.escape(caption)}<br>{thumbs}</div>'


def wav_uri(samples: np.ndarray, rate: int = qaudio.SAMPLE_RATE) -> str:
    """``samples`` (float in [-1, 1], mono) as a 16-bit PCM WAV data URI, which every browser's player plays."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def audio_players(dataset, i: int) -> str:
    """Good sample ``i``'s audios as HTML players (``data.use_audio_in_video``: its videos' tracks too, in the order
    heard), each captioned with its seconds and token count."""
    conv, base = dataset.conversation(i), dataset.sources[dataset.samples[i].source].base_dir
    tracks = dataset.data.use_audio_in_video
    out = []
    for (kind, k), (_, tokens, _) in zip(qaudio.heard(conv, tracks), dataset.index.grids(i, "audio")):
        if kind == "audio":
            samples = qaudio.decode(conv.audios[k], conv.where, base)
        else:
            samples = qaudio.track(dataset.video_refs(i, conv)[k], conv.where)
        caption = f"{'audio' if kind == 'audio' else 'the track of video'} {k}: {len(samples) / qaudio.SAMPLE_RATE:.2f} s, {tokens} tokens"
        out.append(f'<div style="{STYLE["audio"]};display:inline-block;margin:4px">{html.escape(caption)}<br>'
                   f'<audio controls src="{wav_uri(samples)}"></audio></div>')  # fmt: skip
    return "".join(out)


def render_sample(dataset, i: int) -> str:
    """Sample ``i`` as a self-contained HTML block: where it is from, images, video frames, audio players, coloured tokens."""
    sample = dataset[i]
    info = dataset.samples[i]
    ids = sample["input_ids"].tolist()
    labels = sample["labels"].tolist()
    where = html.escape(str(dataset.conversation(i).where))
    images = "".join(
        f'<img src="{thumbnail(im)}" title="{im.width}x{im.height} px, grid {g}" '
        f'style="margin:4px;border:1px solid #ccc;max-height:160px">'
        for im, g in zip(sample_images(dataset, i), info.grids)
    ) + "".join(_video_strip(k, *video, dataset.processor) for k, video in enumerate(sample_videos(dataset, i)))
    images += audio_players(dataset, i)
    spans = []
    for k, text in segments(ids, labels, dataset.processor):
        if k in MEDIA:
            spans.append(f'<span style="{STYLE[k]}">&lt;{k}: {text} tokens&gt;</span>')
        else:
            spans.append(f'<span style="{STYLE[k]}">{html.escape(text)}</span>')
    learned = sum(label != IGNORE_INDEX for label in labels)
    legend = " ".join(f'<span style="{STYLE[k]}">{k}</span>' for k in ("learned", "context", "special", *MEDIA))
    return (
        f'<div style="border:1px solid #ddd;border-radius:6px;padding:10px;margin:8px 0">'
        f"<div><b>sample {i}</b> &middot; {where} &middot; {len(ids)} tokens, {learned} learned"
        f"{' &middot; truncated' if info.truncated else ''}</div>"
        f"<div>{images}</div>"
        f'<pre style="white-space:pre-wrap;font-size:12px;line-height:1.5;margin:6px 0">{"".join(spans)}</pre>'
        f'<div style="font-size:11px;color:#666">{legend}</div></div>'
    )


# ---------------------------------------------------------------------------------------------
# Results

UNITS = {"images": "image", "videos": "video", "audios": "audio"}


def save(
    out_dir, data_path: str, dataset, report, max_length: int, device: str = "cpu", padding_rows=None
) -> dict[str, Any]:
    """``data_summary.csv`` (per-sample counts, bad samples, the length limit; long format) and
    ``metrics.json``; returns the metrics. The figures are drawn from these files (:func:`figures`).

    ``padding_rows``: :func:`padding`'s table, recorded as ``padding_fraction`` by layout.
    """
    dist = distributions(dataset)
    rows = [
        results.record(metric, value, unit=UNITS.get(metric, "token"), series=str(data_path),
                       x_name="sample", x=i, device=device)  # fmt: skip
        for metric, values in dist.items()
        for i, value in enumerate(values)
    ]
    rows += [results.record("bad_samples", n, series=reason, device=device) for reason, n in report.by_reason.items()]
    rows += [results.record("bad_sample", i, series="message", x_name="message", x=m, device=device)
             for i, m in enumerate(report.messages[:BAD_LISTED])]  # fmt: skip
    rows.append(results.record("max_length", max_length, unit="token", series="data.max_length", device=device))
    rows += [results.record(f"padding_{key}", r[col], unit=unit, series=r["layout"], device=device)
             for r in padding_rows or []
             for key, col, unit in (("micro_batches", "micro-batches", "batch"), ("positions", "positions", "token"),
                                    ("fraction", "padding fraction", "ratio"))]  # fmt: skip
    results.write_csv(rows, f"{out_dir}/{SUMMARY_FILE}")
    tokens = percentiles(dist["tokens"])
    over = sum(t > max_length for t in dist["tokens"])
    values = {
        "good": len(dataset),
        "bad": report.skipped,
        "rows": report.total,
        "bad_by_reason": dict(report.by_reason),
        "tokens": tokens,
        "image_tokens_total": int(sum(dist["image_tokens"])),
        "learned_tokens_total": int(sum(dist["learned_tokens"])),
        "images": int(sum(dist["images"])),
        "video_tokens_total": int(sum(dist["video_tokens"])),
        "videos": int(sum(dist["videos"])),
        "audio_tokens_total": int(sum(dist["audio_tokens"])),
        "audios": int(sum(dist["audios"])),
        "over_max_length": over,
        "padding_fraction": {r["layout"]: r["padding fraction"] for r in padding_rows or []},
    }
    summary = (
        f"{len(dataset)} good / {report.skipped} bad of {report.total} rows"
        + (f" ({report.reasons_line()})" if report.skipped else "")
        + (f"; tokens p50 {tokens['p50']:.0f}, max {tokens['max']}" if tokens else "")
        + f"; {values['images']} images, {values['image_tokens_total']} image tokens, "
        + (f"{values['videos']} videos, {values['video_tokens_total']} video tokens, " if values["videos"] else "")
        + (f"{values['audios']} audios, {values['audio_tokens_total']} audio tokens, " if values["audios"] else "")
        + f"{values['learned_tokens_total']} learned tokens"
    )
    results.write_metrics(out_dir, "01_data_prep", summary, passed=len(dataset) > 0, **values)
    return values


def tensor_shapes(batch: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# Figures, drawn from the result files alone


def bad_sample_figures(out_dir) -> list:
    """The bad-sample tables (by reason, then the first messages); none when every row was good."""
    rows = results.read_csv(f"{out_dir}/{SUMMARY_FILE}")
    counts = sorted(results.select(rows, metric="bad_samples"), key=lambda r: -r["value"])
    if not counts:
        return []
    bad = int(sum(r["value"] for r in counts))
    good = len(results.select(rows, metric="tokens"))  # one row per good sample
    by_reason = [{"reason": r["series"], "samples": int(r["value"]), "meaning": REASONS[r["series"]]} for r in counts]
    first = [{"#": int(r["value"]), "bad sample": r["x"]} for r in results.select(rows, metric="bad_sample")]
    return [
        plots.table(by_reason, ["reason", "samples", "meaning"], title=f"{bad} bad of {good + bad} rows"),
        plots.table(first, ["#", "bad sample"], title=f"Bad samples (first {BAD_LISTED})"),
    ]


def distribution_figures(out_dir) -> list:
    """Histograms of tokens (with the data.max_length line), image tokens, video and audio tokens (when any) and learned tokens per sample."""
    rows = results.read_csv(f"{out_dir}/{SUMMARY_FILE}")

    def values(metric: str) -> list[float]:
        return [r["value"] for r in results.select(rows, metric=metric)]

    (limit,) = values("max_length")
    figures = [
        plots.histogram(values("tokens"), "Tokens per sample (text + image + video)", "tokens", limit=int(limit),
                        limit_name="data.max_length"),  # fmt: skip
        plots.histogram(values("image_tokens"), "Image tokens per sample", "image tokens"),
    ]
    if sum(values("videos")):
        figures.append(plots.histogram(values("video_tokens"), "Video tokens per sample", "video tokens"))
    if sum(values("audios")):
        figures.append(plots.histogram(values("audio_tokens"), "Audio tokens per sample", "audio tokens"))
    figures.append(plots.histogram(values("learned_tokens"), "Learned tokens per sample (labels the loss counts)", "tokens"))
    return figures


def padding_figure(out_dir):
    """The padded-vs-packed table of one epoch (:func:`padding`), or None when it was not recorded."""
    rows = results.read_csv(f"{out_dir}/{SUMMARY_FILE}")
    layouts = [r["series"] for r in results.select(rows, metric="padding_fraction")]
    if not layouts:
        return None

    def value(metric: str, layout: str) -> float:
        (row,) = results.select(rows, metric=metric, series=layout)
        return row["value"]

    table = [{"layout": layout, "micro-batches": int(value("padding_micro_batches", layout)),
              "positions": int(value("padding_positions", layout)),
              "padding fraction": value("padding_fraction", layout)} for layout in layouts]  # fmt: skip
    return plots.table(table, ["layout", "micro-batches", "positions", "padding fraction"],
                       title="Padding of one epoch", formats={"padding fraction": ".1%"})  # fmt: skip


def figures(out_dir) -> list:
    """Every figure of notebook 01, in the order it shows them."""
    padding = padding_figure(out_dir)
    return bad_sample_figures(out_dir) + distribution_figures(out_dir) + ([padding] if padding is not None else [])
