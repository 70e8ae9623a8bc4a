"""GRPO's rewards: each completion scored by every name in ``grpo.rewards``, weighted by ``grpo.reward_weights``.

A reward is ``reward(prediction, reference, **row) -> float``: the completion's text, the row's
reference answer and the row's other columns (a user's reward may read them), with ``completion_ids``,
the completion's token ids (its end token included when it ended; TRL's keyword), among them; with
``grpo.environment``, ``environments`` too: TRL's keyword and type, a list of one environment per completion
scored; a reward scores one completion, so it is ``[the completion's own environment]`` (TRL's reward reads
``environments[i]`` for its completion ``i``; here ``i`` is 0), the instance its tools were bound to, after the rollout.

- the answer metrics (``exact``, ``normalized``, ``relaxed``, ``anls``; :mod:`qwenkit.engine.generation.answers`,
  multiple-choice rows by the letter) score the **answer**: the text inside the answer tag
  (``<answer>…</answer>``, ``grpo.format_tags``) when the completion (or the reference) has one,
  else the whole text, so a model that reasons first is scored on what it answers.
- ``format``: 1 when the completion is ``<think>…</think>`` then ``<answer>…</answer>`` and nothing
  else (whitespace between), each tag once; else 0 (TRL's ``think_format_reward`` with the answer tag).
- ``iou``: the intersection over union of the first box in the completion and the reference's box
  (four numbers ``x1, y1, x2, y2``, as ``[x1, y1, x2, y2]`` or Qwen's ``"bbox_2d": [...]``), both in
  the family's convention (``Family.box_units``: pixels of the resized image for Qwen2.5-VL, 0-1000
  of the width and height for Qwen3-VL, whose boxes are clamped to that range); 0 when the
  completion has no box. The reference must be written in the family's convention, as the SFT data
  that taught the model to ground was; a reference in other units is not converted.
- ``overlong``: DAPO's soft overlong punishment (its Eq. 13; TRL's ``get_soft_overlong_punishment``):
  with ``L = grpo.max_new_tokens`` and the buffer ``C = grpo.overlong_buffer``, 0 for a completion of
  ``n <= L - C`` tokens, ``(L - C - n) / C`` above (down to -1 at ``n = L``), -1 beyond ``L``; it reads
  ``completion_ids``. Penalty scale 1: weigh it with ``grpo.reward_weights``.
- ``module:function``: a user's function, importable from ``PYTHONPATH``, logged as
  ``rewards/<function's name>``.

A reward that raises, returns no number, or a value that is not finite, stops the run with one line naming
the reward and the row (:func:`qwenkit.engine.generation.answers.user_score`, the eval metrics' check): on
every rank at the same point (:class:`RewardsStopped`, agreed by the GRPO objective after scoring), the
checkpoints written so far kept, the failing row, its completion and the reward's traceback written to the
run folder's ``reward_failure.json`` (:func:`stopped`) for a notebook to call the reward again with them.
"""

from __future__ import annotations

import json
import re
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from qwenkit.config import EVAL_METRICS, load_user_metric
from qwenkit.engine.generation import answers
from qwenkit.errors import EveryRank

Reward = Callable[..., float]  # reward(prediction, reference, **row) -> float
_NUMBER = r"-?\d+(?:\.\d+)?"
_BOX = re.compile(rf"\[\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*,\s*({_NUMBER})\s*\]")
PER_MILLE = 1000.0  # Qwen3-VL's relative coordinates span 0..1000


def answer_text(text: str, tag: str) -> str:
    """The text inside the last ``<tag>…</tag>`` of ``text``, else ``text`` itself."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL)
    return found[-1].strip() if found else text


def format_reward(think: str, answer: str) -> Reward:
    """1.0 for ``<think>…</think><answer>…</answer>`` alone (whitespace between), else 0.0."""
    pattern = re.compile(
        rf"^\s*<{think}>(?:(?!<{think}>|</{think}>).)*</{think}>\s*<{answer}>(?:(?!<{answer}>|</{answer}>).)*</{answer}>\s*$",
        re.DOTALL,
    )

    def reward(prediction: str, reference: str, **row) -> float:
        return float(pattern.match(prediction) is not None)

    return reward


def first_box(text: str) -> tuple[float, float, float, float] | None:
    """The first ``[x1, y1, x2, y2]`` in ``text`` with its corners ordered, or None."""
    m = _BOX.search(text)
    if m is None:
        return None
    x1, y1, x2, y2 = (float(v) for v in m.groups())
    return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)


def box_iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    """Intersection over union of two ``(x1, y1, x2, y2)`` boxes; 0 when both are empty."""
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def iou_reward(box_units: str) -> Reward:
    """The ``iou`` reward in the family's box convention (module docstring)."""
    if box_units not in ("pixels", "per_mille"):
        raise ValueError(f"box_units must be pixels or per_mille, got {box_units!r}")

    def clamp(box):
        if box_units == "pixels":
            return tuple(max(0.0, v) for v in box)
        return tuple(min(max(0.0, v), PER_MILLE) for v in box)

    def iou(prediction: str, reference: str, **row) -> float:
        ref = first_box(reference)
        if ref is None:
            raise ValueError(f"the iou reward needs a box [x1, y1, x2, y2] in the reference, got {reference!r}")
        pred = first_box(prediction)
        return box_iou(clamp(pred), clamp(ref)) if pred is not None else 0.0

    return iou


def overlong_reward(max_new_tokens: int, buffer: int) -> Reward:
    """The ``overlong`` reward of completions limited to ``max_new_tokens``, penalised over the last ``buffer`` (module docstring)."""
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"grpo.overlong_buffer must be in [1, grpo.max_new_tokens={max_new_tokens}], got {buffer}")
    free = max_new_tokens - buffer  # the longest completion that goes unpunished

    def overlong(prediction: str, reference: str, completion_ids: list[int], **row) -> float:
        n = len(completion_ids)
        return 0.0 if n <= free else -1.0 if n > max_new_tokens else (free - n) / buffer

    return overlong


def resolve(names: list[str], box_units: str, format_tags: tuple[str, str] = ("think", "answer"), max_new_tokens: int = 0,
            overlong_buffer: int = 0) -> dict[str, Reward]:  # fmt: skip
    """``{logged name: reward}`` for ``grpo.rewards`` (the config check has vetted the names);
    ``max_new_tokens`` and ``overlong_buffer``: the ``overlong`` reward's limit and buffer."""
    think, answer = format_tags
    out: dict[str, Reward] = {}
    for name in names:
        if name in EVAL_METRICS:
            out[name] = _on_answers(answers.resolve([name])[name], answer)
        elif name == "format":
            out[name] = format_reward(think, answer)
        elif name == "iou":
            out[name] = iou_reward(box_units)
        elif name == "overlong":
            out[name] = overlong_reward(max_new_tokens, overlong_buffer)
        else:
            fn = load_user_metric(name, "grpo.rewards")
            out[fn.__name__] = fn
    return out


def _on_answers(metric: answers.Metric, tag: str) -> Reward:
    def reward(prediction: str, reference: str, **row) -> float:
        return metric(answer_text(prediction, tag), answer_text(reference, tag))

    return reward


class RewardError(answers.UserFunctionError):
    """A reward that raised or returned no finite number on a completion, with what reproduces it
    (``record``: the reward, the row, the completion's ``position`` among those scored, the completion, its
    reference, the row's columns, the error and the traceback)."""

    def __init__(self, message: str, record: dict):
        super().__init__(message)
        self.record = record


class RewardsStopped(answers.UserFunctionError, EveryRank):
    """What every rank raises once a reward failed on any rank (:func:`stopped`): the first failure's line
    and the file that holds every failing rank's record."""


def stopped(records: list[dict | None], step: int, path: Path | None, write: bool) -> RewardsStopped:
    """The error every rank raises at ``step`` when the reward failed on some ranks (``records``: each
    rank's :class:`RewardError` record, or None), naming the first and the file where ``write`` (rank 0)
    puts them all (``path``, the run folder's :data:`qwenkit.rundir.REWARD_FAILURE`; None: no file)."""
    failed = [{"rank": r, "step": step, **record} for r, record in enumerate(records) if record is not None]
    first = failed[0]
    where = ""
    if path is not None:
        if write:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(failed, indent=1, default=repr) + "\n")
        where = f"; its row, completion and traceback (and any other rank's) are in {path}"
    return RewardsStopped(f"{first['error']} (rank {first['rank']}, step {step}){where}; fix the reward, then run the "
                          "same command again: train.resume=auto goes on from the newest checkpoint")  # fmt: skip


def score(
    rewards: dict[str, Reward],
    weights: list[float],
    predictions: list[str],
    references: list[str],
    rows: list[dict],
    row_names: list[str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(per reward [N, K], weighted sum [N])`` float32 of ``N`` completions; ``weights`` empty: all 1.

    ``rows[i]``: the columns passed to the rewards as keywords; ``row_names[i]``: how an error names
    that row (``train.jsonl row 12``).
    """
    weights = weights or [1.0] * len(rewards)
    values = torch.zeros(len(predictions), len(rewards), dtype=torch.float32)
    for i, (prediction, reference, row, where) in enumerate(zip(predictions, references, rows, row_names, strict=True)):
        extra = {k: v for k, v in row.items() if k not in ("prediction", "reference")}
        for k, (name, reward) in enumerate(rewards.items()):
            # the eval metrics' one check of a user's scoring function: any finite number (no [0, 1] bound)
            try:
                values[i, k] = answers.user_score(reward, f"grpo.rewards {name!r}", where, prediction, reference,
                                                  bounds=None, **extra)  # fmt: skip
            except answers.UserFunctionError as e:  # what a notebook needs to call the reward again the same way
                record = {"reward": name, "row": where, "position": i, "completion": prediction, "reference": reference,
                          "columns": extra,
                          "error": str(e), "traceback": "".join(traceback.format_exception(e.__cause__ or e))}  # fmt: skip
                raise RewardError(str(e), record) from e
    return values, values @ torch.tensor(weights, dtype=torch.float32)


__all__ = ["Reward", "RewardError", "RewardsStopped", "answer_text", "box_iou", "first_box", "format_reward",
           "iou_reward", "overlong_reward", "resolve", "score", "stopped"]  # fmt: skip
