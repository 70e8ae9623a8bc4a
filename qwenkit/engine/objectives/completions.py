"""GRPO's completions file, ``metrics/completions.jsonl`` beside the metrics: a sample of each logged step's
rollout, written by rank 0 (the line format: :mod:`qwenkit.engine.objectives.grpo`'s docstring), and its reader."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qwenkit.engine.rollouts.completion import Completion
from qwenkit.records import read_jsonl

SAMPLE_FILE = "completions.jsonl"  # beside the metrics: a sample of each logged step's completions (rank 0's)
SAMPLE_GROUPS = 8  # prompts of rank 0's rollout written per logged step, each with all its completions


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
    (assistant replies with their ``tool_calls``, ``tool`` responses whose images are ``{"type": "image", "size"}``
    placeholders), ``model_tokens``, ``tool_tokens``, ``turns``, ``tool_calls`` and ``tool_failures``; {} otherwise."""
    return dict(c.trajectory) if c.trajectory is not None else {}


def append(path: Path, step: int, lines: list[dict]) -> None:
    """A logged step's write: ``lines`` with their ``step`` and place ``k`` (0 begins the write)."""
    path.parent.mkdir(parents=True, exist_ok=True)
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


__all__ = ["SAMPLE_FILE", "SAMPLE_GROUPS", "append", "read_completions", "sample", "trajectory"]
