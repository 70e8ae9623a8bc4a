"""A dataset as the model will see it, for notebook 01: distributions and rendered samples.

:func:`render_sample` shows one encoded sample as HTML: its images (thumbnails embedded as
PNG data URIs, so a report stays one file) and its templated token stream, token runs coloured
by what they are: **learned** (labels kept: assistant replies and their ``<|im_end|>``),
context (ignored by the loss), special tokens, and image spans collapsed to one chip per image.
The colouring comes from the sample's ``labels`` tensor, i.e. from exactly what training uses.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

import numpy as np
import torch

from qwenkit.data import REASONS
from qwenkit.data.images import load, resolve
from qwenkit.notebooks import results
from qwenkit.processor import SPECIAL_TOKENS, Processor

IGNORE_INDEX = -100
STYLE = {
    "learned": "background:#c8f7c5;border-bottom:2px solid #1a7f37",
    "context": "",
    "special": "color:#8250df;font-weight:600",
    "image": "background:#ddf4ff;border:1px solid #54aeff;border-radius:3px;padding:0 3px;color:#0969da",
}


# ---------------------------------------------------------------------------------------------
# Distributions


def distributions(dataset) -> dict[str, list[int]]:
    """Per good sample: total tokens, image tokens, learned tokens, images."""
    image_tokens = [sum(dataset.processor.image_tokens(g) for g in s.grids) for s in dataset.samples]
    return {
        "tokens": [s.length for s in dataset.samples],
        "image_tokens": image_tokens,
        "learned_tokens": [s.label_tokens for s in dataset.samples],
        "images": [len(s.grids) for s in dataset.samples],
    }


def percentiles(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    a = np.asarray(values)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"min": int(a.min()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": int(a.max())}


def bad_sample_rows(report, limit: int = 50) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(by_reason, first_messages)`` table rows of a :class:`BadSampleReport`."""
    by_reason = [
        {"reason": r, "samples": n, "meaning": REASONS[r]}
        for r, n in sorted(report.by_reason.items(), key=lambda kv: -kv[1])
    ]
    messages = [{"#": i, "bad sample": m} for i, m in enumerate(report.messages[:limit])]
    return by_reason, messages


# ---------------------------------------------------------------------------------------------
# One sample as HTML


def segments(input_ids: list[int], labels: list[int], processor: Processor) -> list[tuple[str, str]]:
    """``(kind, text)`` runs of one sample: kind in learned / context / special / image.

    Consecutive tokens of one kind are decoded together, so a character split over several
    byte-level tokens (CJK text) comes out whole. An image span's pad tokens become one
    ``image`` run whose text is the token count.
    """
    tok = processor.tokenizer
    special = {tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}

    def kind(i: int) -> str:
        if input_ids[i] == processor.image_token_id:
            return "image"
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
        text = f"{len(ids)}" if k == "image" else tok.decode(ids, skip_special_tokens=False)
        out.append((k, text))
    return out


def _thumbnail(image, side: int = 160) -> str:
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


def render_sample(dataset, i: int) -> str:
    """Sample ``i`` as a self-contained HTML block: where it is from, images, coloured tokens."""
    sample = dataset[i]
    info = dataset.samples[i]
    ids = sample["input_ids"].tolist()
    labels = sample["labels"].tolist()
    where = html.escape(str(dataset.conversation(i).where))
    images = "".join(
        f'<img src="{_thumbnail(im)}" title="{im.width}x{im.height} px, grid {g}" '
        f'style="margin:4px;border:1px solid #ccc;max-height:160px">'
        for im, g in zip(sample_images(dataset, i), info.grids)
    )
    spans = []
    for k, text in segments(ids, labels, dataset.processor):
        if k == "image":
            spans.append(f'<span style="{STYLE[k]}">&lt;image: {text} tokens&gt;</span>')
        else:
            spans.append(f'<span style="{STYLE[k]}">{html.escape(text)}</span>')
    learned = sum(label != IGNORE_INDEX for label in labels)
    legend = " ".join(f'<span style="{STYLE[k]}">{k}</span>' for k in ("learned", "context", "special", "image"))
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


def save(out_dir, data_path: str, dataset, report, max_length: int, device: str = "cpu") -> dict[str, Any]:
    """``data_summary.csv`` (per-sample counts, long format) and ``metrics.json``; returns the metrics."""
    dist = distributions(dataset)
    rows = [
        results.record(metric, value, unit="token" if metric != "images" else "image", series=str(data_path),
                       x_name="sample", x=i, device=device)  # fmt: skip
        for metric, values in dist.items()
        for i, value in enumerate(values)
    ]
    rows += [results.record("bad_samples", n, series=reason, device=device) for reason, n in report.by_reason.items()]
    results.write_csv(rows, f"{out_dir}/data_summary.csv")
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
        "over_max_length": over,
    }
    summary = (
        f"{len(dataset)} good / {report.skipped} bad of {report.total} rows"
        + (f" ({report.reasons_line()})" if report.skipped else "")
        + (f"; tokens p50 {tokens['p50']:.0f}, max {tokens['max']}" if tokens else "")
        + f"; {values['images']} images, {values['image_tokens_total']} image tokens, "
        f"{values['learned_tokens_total']} learned tokens"
    )
    results.write_metrics(out_dir, "01_data_prep", summary, passed=len(dataset) > 0, **values)
    return values


def tensor_shapes(batch: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in batch.items()}
