"""A sweep's ledger, ``<sweep dir>/sweep.jsonl``, its table, and the result line of a trial.

The ledger is append-only JSON lines, one row each time a trial changes state::

    {"trial": "lr0.003-seed1", "status": "running", "overrides": ["train.lr=0.003", "train.seed=1"],
     "varied": {"train.lr": 0.003, "train.seed": 1}, "start": "2026-...", "end": null,
     "exit_code": null, "error": null, "metrics": {}, "attempt": 1}

An ended attempt's row also has ``wall_s`` (its seconds) and ``resumed_from`` (the checkpoint step it
resumed from, or null); ``metrics.wall_time`` sums the ended attempts (a killed one's time is not known).
``status`` is ``running`` (started; a row left so after the sweep process died means the trial
was interrupted), ``done``, ``failed`` or ``interrupted``; the last row of a trial is its state.
``metrics`` of a finished trial are :func:`qwenkit.engine.run.metrics.final_metrics` of its folder. The run's own
``metrics/rank-*.jsonl`` stay the source of truth: the ledger only says which trial is where.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qwenkit import records

LEDGER = "sweep.jsonl"
STATUSES = ("running", "done", "failed", "interrupted")
def now() -> str:
    """The ledger's timestamps: :func:`qwenkit.records.now` (UTC, milliseconds), as every qwenkit file."""
    return records.now()


def append(sweep_dir: str | Path, row: dict[str, Any]) -> None:
    """Add one row (flushed and fsynced: a killed sweep loses no state it reported)."""
    if row.get("status") not in STATUSES:
        raise ValueError(f"ledger status must be one of {', '.join(STATUSES)}, got {row.get('status')!r}")
    records.append_jsonl(Path(sweep_dir) / LEDGER, row, sync=True)


def read(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Every row, in file order; a half-written last line (a killed writer) is left out."""
    path = Path(sweep_dir) / LEDGER
    return records.read_jsonl(path) if path.is_file() else []


def latest(sweep_dir: str | Path) -> dict[str, dict[str, Any]]:
    """``{trial: its last row}``, in the order trials first appear."""
    out: dict[str, dict[str, Any]] = {}
    for row in read(sweep_dir):
        out[row["trial"]] = row
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


def result_text(row: dict[str, Any]) -> str:
    """``done in 31 s: loss 0.27, eval_loss 0.28, eval_accuracy 0.47`` (or the failure and its error)."""
    m = row.get("metrics") or {}
    wall = m.get("wall_time")
    head = f"{row['status']}" + (" earlier" if row.get("skipped") else "")
    head += f" in {wall:.0f} s" if isinstance(wall, (int, float)) else ""
    if row.get("resumed_from"):
        head += f" (resumed from step {row['resumed_from']})"
    if row["status"] != "done":
        return f"{head}, exit code {row.get('exit_code')}: {row.get('error') or ''}".rstrip(": ")
    shown = [f"{k} {m[k]:.4g}" for k in ("loss", "eval_loss", "eval_accuracy") if isinstance(m.get(k), (int, float))]
    return f"{head}: " + ", ".join(shown) if shown else head
