"""Notebook 02's held-out rows before and after training: their answers, scores and a gallery.

:func:`save_eval_samples` pairs the held-out rows' untrained (step 0) and trained (last evaluation)
answers of a run (its ``eval/step-*.jsonl``, :mod:`qwenkit.engine.generation.evaluate`) into
``eval_samples.jsonl`` with every metric's score, which :func:`score_table` (means, rows that went
from wrong to right and back) and :func:`gallery` (all rows, or only those that changed) show.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from PIL import Image

from qwenkit import records
from qwenkit.notebooks import plots, results
from qwenkit.notebooks.samples import thumbnail

EVAL_SAMPLES = "eval_samples.jsonl"  # notebook 02's gallery rows: reference, untrained and trained answers and scores
RIGHT = 0.5  # a row counts as answered right when its score reaches this (0/1 metrics: a match; ANLS: within its threshold)


def row_scores(row: dict) -> dict[str, float]:
    """A generations row's scores; a file written before scores existed has its exact ``match``."""
    return row["scores"] if "scores" in row else {"exact": float(row["match"])}


def save_eval_samples(out_dir, run_dir) -> list[dict[str, Any]]:
    """Pair each held-out row's answers and scores at the first (step 0: untrained) and last
    evaluation of ``run_dir`` into ``<out_dir>/eval_samples.jsonl``; returns the rows. A row's
    ``*_match`` is whether its first metric's score counts as right (:data:`RIGHT`)."""
    files = sorted((Path(run_dir) / "eval").glob("step-*.jsonl"))  # zero-padded steps: sorted by step
    if not files:
        raise FileNotFoundError(f"{Path(run_dir) / 'eval'}: no step-*.jsonl; did the run have an eval set and train.eval_samples > 0?")
    steps = [int(f.stem.split("-")[1]) for f in (files[0], files[-1])]
    before, after = records.read_jsonl(files[0]), {r["index"]: r for r in records.read_jsonl(files[-1])}
    rows = []
    for b in before:
        a = after.get(b["index"])
        if a is None:
            raise ValueError(f"{files[-1]}: eval row {b['index']} of {files[0]} is missing")
        sb, sa = row_scores(b), row_scores(a)
        first = next(iter(sb))
        rows.append({
            "index": b["index"], "prompt": b["prompt"], "images": b["images"], "reference": b["reference"],
            "untrained_step": steps[0], "untrained": b["generated"], "untrained_scores": sb,
            "untrained_match": sb[first] >= RIGHT,
            "trained_step": steps[1], "trained": a["generated"], "trained_scores": sa, "trained_match": sa[first] >= RIGHT,
        })  # fmt: skip
    results.write_jsonl(rows, Path(out_dir) / EVAL_SAMPLES)
    return rows


def _eval_samples(out_dir) -> list[dict[str, Any]]:
    return records.read_jsonl(Path(out_dir) / EVAL_SAMPLES)


def score_rows(out_dir) -> list[dict[str, Any]]:
    """Per metric of ``eval_samples.jsonl``: its mean untrained and trained, and how many rows
    went from wrong to right and from right to wrong (:data:`RIGHT`)."""
    rows = _eval_samples(out_dir)
    out = []
    for name in rows[0]["untrained_scores"] if rows else []:
        before = [r["untrained_scores"][name] for r in rows]
        after = [r["trained_scores"][name] for r in rows]
        out.append({
            "metric": name, "untrained": sum(before) / len(rows), "trained": sum(after) / len(rows),
            "wrong -> right": sum(b < RIGHT <= a for b, a in zip(before, after)),
            "right -> wrong": sum(a < RIGHT <= b for b, a in zip(before, after)), "rows": len(rows),
        })  # fmt: skip
    return out


def score_table(out_dir):
    rows = score_rows(out_dir)
    return plots.table(rows, list(rows[0]) if rows else ["metric"], title="Held-out scores, untrained -> trained",
                       formats={"untrained": ".3f", "trained": ".3f"})  # fmt: skip


def _image_cell(path: str) -> str:
    """A thumbnail of an image file, or its label where the row's image is embedded or gone."""
    if Path(path).is_file():
        with Image.open(path) as im:
            return f'<img src="{thumbnail(im, 96)}" style="border:1px solid #ccc;max-height:96px">'
    return f"<code>{html.escape(path)}</code>"


def gallery(out_dir, limit: int = 8, changed: bool = False):
    """The first ``limit`` held-out rows of ``eval_samples.jsonl`` as an HTML table: image,
    reference, untrained and trained answers (green where they count as right by the first
    metric); ``changed``: only the rows that went from wrong to right or back."""
    from IPython.display import HTML

    every = _eval_samples(out_dir)
    rows = [r for r in every if r["untrained_match"] != r["trained_match"]] if changed else every
    ok, bad = "background:#e6f4ea", "background:#fdecea"
    cells = []
    for r in rows[:limit]:
        cells.append(
            "<tr><td>" + "".join(_image_cell(p) for p in r["images"]) + "</td>"
            f"<td><pre style='white-space:pre-wrap;margin:0'>{html.escape(r['prompt'])}</pre></td>"
            f"<td>{html.escape(r['reference'])}</td>"
            f"<td style='{ok if r['untrained_match'] else bad}'>{html.escape(r['untrained'])}</td>"
            f"<td style='{ok if r['trained_match'] else bad}'>{html.escape(r['trained'])}</td></tr>"
        )
    step0, step1 = (every[0]["untrained_step"], every[0]["trained_step"]) if every else (0, 0)
    head = (f"<tr><th>image</th><th>prompt</th><th>reference</th><th>untrained (step {step0})</th>"
            f"<th>trained (step {step1})</th></tr>")  # fmt: skip
    what = "rows that changed between wrong and right" if changed else "held-out rows"
    return HTML(f'<table class="eval-gallery">{head}{"".join(cells)}</table>'
                f"<p>{min(limit, len(rows))} of {len(rows)} {what}</p>")  # fmt: skip
