"""Notebook 02's view of an agentic GRPO run's trajectories (``grpo.tools`` / ``grpo.environment``), from its files alone.

Rank 0's completions file (``metrics/completions.jsonl``, :mod:`qwenkit.engine.objectives.completions`) holds each
sampled trajectory as chat messages: the assistant's replies with their parsed ``tool_calls``, the ``tool``
responses (text, and images as files in ``metrics/tool_images/``, as the tool returned them). :func:`chosen` picks
a step's trajectories, those that called a tool first; :func:`trajectory_html` draws one as a chat (replies,
calls with their arguments, responses with their images inline as data URIs, so the HTML report stands alone);
:func:`view` shows a few of them.

Cannot: show the prompt (the file names its dataset row, ``index``), nor the image as the model saw it (the
image processor resized it to its patch grid; the view shows the tool's own image, its size in the caption).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from PIL import Image

from qwenkit.engine.objectives.completions import read_completions
from qwenkit.notebooks.samples import thumbnail

IMAGE_SIDE = 160  # a tool image's longest side in the view (px)
NONE = ("no agentic trajectory in this run's completions file (a run with grpo.tools or grpo.environment writes "
        "them at its logged steps)")  # fmt: skip


def chosen(run_dir, step: int | None = None, limit: int = 4) -> tuple[int | None, list[dict[str, Any]]]:
    """``(step, lines)``: up to ``limit`` trajectories of ``step`` (None: the last logged step that has any), those
    that called a tool first, then by reward (highest first), then in file order."""
    by_step = {s: [r for r in rows if "messages" in r] for s, rows in read_completions(run_dir).items()}
    steps = [s for s in sorted(by_step) if by_step[s]]
    if step is None:
        step = steps[-1] if steps else None
    lines = by_step.get(step, [])
    ranked = sorted(range(len(lines)), key=lambda k: (-min(lines[k]["tool_calls"], 1), -lines[k]["reward"], k))
    return step, [lines[k] for k in ranked[:limit]]


def _text(text: str) -> str:
    return f"<pre style='white-space:pre-wrap;margin:0'>{html.escape(text)}</pre>"


def _image(part: dict, metrics_dir: Path) -> str:
    """A tool image inline (a data URI of its file), captioned with its size; its file gone: the caption alone."""
    w, h = part["size"]
    path = metrics_dir / part["file"] if "file" in part else None
    if path is None or not path.is_file():
        return f"<code>[image {w}x{h}: {html.escape(part.get('file', 'not kept'))}]</code>"
    with Image.open(path) as im:
        uri = thumbnail(im, IMAGE_SIDE)
    return (f'<figure style="display:inline-block;margin:2px 6px"><img class="tool-image" src="{uri}" '
            f'style="border:1px solid #ccc;image-rendering:pixelated;width:{IMAGE_SIDE}px">'
            f"<figcaption>{w}x{h}</figcaption></figure>")  # fmt: skip


def _message(m: dict, metrics_dir: Path) -> str:
    """One chat message as a row: who, then what it said (an assistant's calls; a tool's text and images)."""
    if m["role"] == "assistant":
        body = _text(m["content"])
        for call in m.get("tool_calls", []):
            f = call["function"]
            arguments = json.dumps(f["arguments"], ensure_ascii=False)
            body += f"<div>&rarr; calls <b>{html.escape(f['name'])}</b>(<code>{html.escape(arguments)}</code>)</div>"
        return f"<tr><td><b>assistant</b></td><td>{body}</td></tr>"
    parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
    body = "".join(_image(p, metrics_dir) if p["type"] == "image" else _text(p["text"]) for p in parts)
    return f"<tr style='background:#f4f6fa'><td><b>tool</b> {html.escape(m.get('name', ''))}</td><td>{body}</td></tr>"


def trajectory_html(line: dict, metrics_dir) -> str:
    """One completions-file line's trajectory as an HTML table: a header (row, reference, rewards, turns, calls,
    failed calls, model and tool tokens), then each message in order."""
    rewards = ", ".join(f"{k} {v:.2f}" for k, v in line["rewards"].items())
    head = (f"row {line['index']} · reference <code>{html.escape(line['reference'])}</code> · reward "
            f"{line['reward']:.2f} ({rewards}) · {line['turns']} turns, {line['tool_calls']} calls "
            f"({line['tool_failures']} failed) · {line['model_tokens']} model / {line['tool_tokens']} tool tokens"
            + (" · cut" if line["truncated"] else ""))  # fmt: skip
    rows = "".join(_message(m, Path(metrics_dir)) for m in line["messages"])
    return f'<table class="trajectory" style="margin-bottom:1em"><caption style="text-align:left">{head}</caption>{rows}</table>'


def view(run_dir, step: int | None = None, limit: int = 4):
    """:func:`chosen`'s trajectories of ``run_dir`` as HTML, with a line saying which (or :data:`NONE`)."""
    from IPython.display import HTML

    step, lines = chosen(run_dir, step, limit)
    if not lines:
        return HTML(f'<p class="trajectories">{NONE}</p>')
    metrics_dir = Path(run_dir) / "metrics"
    tables = "".join(trajectory_html(line, metrics_dir) for line in lines)
    return HTML(f'<div class="trajectories">{tables}<p>{len(lines)} trajectories of step {step} (rank 0\'s), '
                "those that called a tool first</p></div>")  # fmt: skip


__all__ = ["IMAGE_SIDE", "NONE", "chosen", "trajectory_html", "view"]
