"""GRPO's completions file, ``metrics/completions.jsonl`` beside the metrics: a sample of each logged step's
rollout, written by rank 0 (the line format: :mod:`qwenkit.engine.objectives.grpo`'s docstring), and its reader.

**Tools' images** (agentic trajectories, :mod:`qwenkit.engine.rollouts.agentic`) are kept as the tool returned them
(before the image processor's resize), one PNG file each in ``metrics/tool_images/`` named by its content's hash
(the same crop in several completions is one file); the line's image part ``{"type": "image", "size": [w, h],
"file": "tool_images/<hash>.png"}`` names it, relative to the metrics folder. A file, not the line: a screenshot
is hundreds of KB, a line is read whole by every reader. Between the rollout and the write (a checkpoint in the
middle of a ``grpo.num_iterations`` cycle included) the image is its PNG, base64 (``"png"``): plain data.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import torch

from qwenkit.engine.rollouts.completion import Completion
from qwenkit.records import read_jsonl

SAMPLE_FILE = "completions.jsonl"  # beside the metrics: a sample of each logged step's completions (rank 0's)
SAMPLE_GROUPS = 8  # prompts of rank 0's rollout written per logged step, each with all its completions
TOOL_IMAGES = "tool_images"  # beside the completions file: the images the tools of its trajectories returned


def sample(done: list[Completion], per: torch.Tensor, total: torch.Tensor, adv: torch.Tensor, epochs: list[int],
           rewards: list[str], num_generations: int, rollout: int) -> list[dict]:  # fmt: skip
    """The file's lines of a rollout's first :data:`SAMPLE_GROUPS` groups, without their step: each completion with
    its ``rewards`` (by name, of ``per``), weighted reward, advantage and the epoch it was drawn in."""
    kept = SAMPLE_GROUPS * num_generations
    return [{"rollout": rollout, "epoch": epoch, "index": c.index, "completion": c.text, "reference": c.reference,
             "rewards": dict(zip(rewards, values)), "reward": r, "advantage": a, "truncated": c.truncated,
             **trajectory(c)}
            for c, values, r, a, epoch in zip(done[:kept], per.tolist(), total.tolist(), adv.tolist(), epochs)]  # fmt: skip


def trajectory(c: Completion) -> dict:
    """An agentic completion's whole trajectory (:mod:`qwenkit.engine.rollouts.agentic`): its chat ``messages``
    (assistant replies with their ``tool_calls``, ``tool`` responses whose images are ``{"type": "image", "size",
    "png"}``, the PNG base64 until :func:`append` writes it as a file), ``model_tokens``, ``tool_tokens``, ``turns``,
    ``tool_calls`` and ``tool_failures``; {} otherwise."""
    if c.trajectory is None:
        return {}
    messages = [m | {"content": [_encoded(p) for p in m["content"]]} if m["role"] == "tool" else m
                for m in c.trajectory["messages"]]  # fmt: skip
    return {**c.trajectory, "messages": messages}


def _encoded(part: dict) -> dict:
    if part.get("type") != "image" or "image" not in part:
        return part
    buf = io.BytesIO()
    part["image"].save(buf, format="PNG")
    return {"type": "image", "size": part["size"], "png": base64.b64encode(buf.getvalue()).decode()}


def _filed(line: dict, folder: Path) -> dict:
    """``line`` with each tool image's PNG written into ``folder`` (named by its hash) and named by its file."""
    if "messages" not in line:
        return line
    messages = []
    for m in line["messages"]:
        if m["role"] == "tool":
            parts = []
            for p in m["content"]:
                if "png" in p:
                    data = base64.b64decode(p["png"])
                    name = f"{TOOL_IMAGES}/{hashlib.sha256(data).hexdigest()[:20]}.png"
                    if not (folder / name).is_file():
                        (folder / TOOL_IMAGES).mkdir(exist_ok=True)
                        (folder / name).write_bytes(data)
                    p = {"type": "image", "size": p["size"], "file": name}
                parts.append(p)
            m = m | {"content": parts}
        messages.append(m)
    return line | {"messages": messages}


def append(path: Path, step: int, lines: list[dict]) -> None:
    """A logged step's write: ``lines`` with their ``step`` and place ``k`` (0 begins the write), their tools'
    images as files beside (module docstring)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [_filed(line, path.parent) for line in lines]
    with open(path, "a") as f:
        f.writelines(json.dumps({"step": step, "k": k, **line}) + "\n" for k, line in enumerate(lines))


def read_completions(output_dir: str | Path) -> dict[int, list[dict]]:
    """A run's completions file as ``{step: lines}``; a step written twice (a resumed run ran it again)
    keeps its last write, as :func:`qwenkit.engine.run.metrics.series` keeps a metric's last row."""
    out: dict[int, list[dict]] = {}
    for line in read_jsonl(Path(output_dir) / "metrics" / SAMPLE_FILE):
        if line["k"] == 0:  # a write of this step begins
            out[line["step"]] = []
        out[line["step"]].append(line)
    return out


__all__ = ["SAMPLE_FILE", "SAMPLE_GROUPS", "TOOL_IMAGES", "append", "read_completions", "sample", "trajectory"]
