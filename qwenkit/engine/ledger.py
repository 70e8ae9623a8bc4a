"""A sweep's ledger, ``<sweep dir>/sweep.jsonl``, and the final metrics of one run folder.

The ledger is append-only JSON lines, one row each time a trial changes state::

    {"trial": "lr0.003-seed1", "status": "running", "overrides": ["train.lr=0.003", "train.seed=1"],
     "varied": {"train.lr": 0.003, "train.seed": 1}, "start": "2026-...", "end": null,
     "exit_code": null, "error": null, "metrics": {}, "attempt": 1}

An ended attempt's row also has ``wall_s`` (its seconds) and ``resumed_from`` (the checkpoint step it
resumed from, or null); ``metrics.wall_time`` sums the ended attempts (a killed one's time is not known).
``status`` is ``running`` (started; a row left so after the sweep process died means the trial
was interrupted), ``done``, ``failed`` or ``interrupted``; the last row of a trial is its state.
``metrics`` of a finished trial are :func:`final_metrics` of its folder. The run's own
``metrics/rank-*.jsonl`` stay the source of truth: the ledger only says which trial is where.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
from pathlib import Path
from typing import Any

from qwenkit.engine import metrics

LEDGER = "sweep.jsonl"
STATUSES = ("running", "done", "failed", "interrupted")
PARAMETERS_FILE = "parameters.json"  # the trainer's parameter manifest (total, trainable per part)

# The final-metrics columns, in the order tables show them: key -> (label, unit).
FINAL = {
    "eval_loss": ("eval loss", "nat"),
    "eval_accuracy": ("eval accuracy", "1"),
    "loss": ("final loss", "nat"),
    "tokens_per_s": ("tokens/s (median)", "token/s"),
    "step_time": ("step time (median)", "s"),
    "peak_memory": ("peak memory (max)", "MiB"),
    "wall_time": ("wall time", "s"),
    "trainable_params": ("trainable params", "1"),
    "steps": ("steps", "1"),
}
LOWER_IS_BETTER = {"eval_loss", "loss", "step_time", "peak_memory", "wall_time"}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def append(sweep_dir: str | Path, row: dict[str, Any]) -> None:
    """Add one row (flushed and fsynced: a killed sweep loses no state it reported)."""
    if row.get("status") not in STATUSES:
        raise ValueError(f"ledger status must be one of {', '.join(STATUSES)}, got {row.get('status')!r}")
    path = Path(sweep_dir) / LEDGER
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Every row, in file order; a half-written last line (a killed writer) is left out."""
    path = Path(sweep_dir) / LEDGER
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n") and line.strip():
            rows.append(json.loads(line))
    return rows


def latest(sweep_dir: str | Path) -> dict[str, dict[str, Any]]:
    """``{trial: its last row}``, in the order trials first appear."""
    out: dict[str, dict[str, Any]] = {}
    for row in read(sweep_dir):
        out[row["trial"]] = row
    return out


def final_metrics(run_dir: str | Path, wall_time: float | None = None) -> dict[str, Any]:
    """A run's headline numbers from its metrics files: the last eval loss, eval accuracy and
    training loss (rank 0; a step logged twice keeps its last row), the median tokens/s and step
    time (rank 0), the largest peak memory of any rank, the trainable parameters (the trainer's
    ``parameters.json``), the last step, and ``wall_time`` as given."""
    rows = metrics.read(run_dir)
    out: dict[str, Any] = {}
    for name in ("eval_loss", "eval_accuracy", "loss"):
        s = metrics.series(rows, name)
        out[name] = s[max(s)] if s else None
    for name in ("tokens_per_s", "step_time"):
        s = metrics.series(rows, name)
        out[name] = statistics.median(s.values()) if s else None
    peaks = [r["value"] for r in rows if r["metric"] == "peak_memory"]
    out["peak_memory"] = max(peaks) if peaks else None
    out["wall_time"] = wall_time
    manifest = Path(run_dir) / PARAMETERS_FILE
    out["trainable_params"] = (
        sum(part["trainable"] for part in json.loads(manifest.read_text()).values()) if manifest.is_file() else None
    )
    steps = metrics.series(rows, "loss")
    out["steps"] = max(steps) if steps else 0
    return out


def table_rows(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """The ledger as rows for a table: trial, status, attempts, wall time, the headline metrics, error."""
    rows = []
    for trial, row in latest(sweep_dir).items():
        m = row.get("metrics") or {}
        rows.append({
            "trial": trial, "status": row["status"], "attempt": row.get("attempt", 1),
            "exit": "" if row.get("exit_code") is None else row["exit_code"],
            "steps": m.get("steps", ""), "loss": m.get("loss"), "eval_loss": m.get("eval_loss"),
            "eval_accuracy": m.get("eval_accuracy"), "wall_s": m.get("wall_time"), "error": row.get("error") or "",
        })  # fmt: skip
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Plain-text columns (numbers to 4 significant digits), for ``qwenkit sweep status``."""
    if not rows:
        return "(no trials yet)"
    cols = list(rows[0])

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[cell(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)
