"""Results as plain files: long-format rows in CSV or JSONL, and one ``metrics.json`` per notebook.

A long-format row (:mod:`qwenkit.records`, the same row training metrics use) is one measured
number with what it is and where it came from::

    metric, unit, series, x_name, x, value, device, version, timestamp

Figures in :mod:`qwenkit.notebooks.plots` are built from these rows, so a report can be redrawn
from its files alone.

``metrics.json`` holds a notebook's headline: a one-line ``summary`` (the report index shows it),
the numbers the tests assert on, and whether the notebook's own checks passed.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import qwenkit
from qwenkit.records import FIELDS, now
from qwenkit.records import (
    read_jsonl as read_jsonl,  # re-exported: a benchmark's --out is read through results
)
from qwenkit.records import record as record  # re-exported: the notebook layer writes rows through results

METRICS_FILE = "metrics.json"


def write_csv(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in FIELDS})
    return path


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a long-format CSV; ``value`` (and a numeric ``x``) come back as numbers."""
    with Path(path).open(newline="") as f:
        return [_typed(row) for row in csv.DictReader(f)]


def _typed(row: dict[str, Any]) -> dict[str, Any]:
    row["value"] = float(row["value"])
    row["x"] = _number(row["x"])
    return row


def _number(text: Any) -> Any:
    if not isinstance(text, str) or not text:
        return text
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def select(rows: Iterable[dict[str, Any]], **where: Any) -> list[dict[str, Any]]:
    """Rows whose fields equal every ``where`` value, e.g. ``select(rows, metric="loss")``."""
    return [r for r in rows if all(r.get(k) == v for k, v in where.items())]


def write_metrics(out_dir: str | Path, notebook: str, summary: str, passed: bool, **values: Any) -> Path:
    """``<out_dir>/metrics.json``: the notebook's one-line summary, its checks, its numbers.

    Non-finite floats are written as ``null`` (strict JSON has no NaN).
    """
    path = Path(out_dir) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "notebook": notebook,
        "summary": summary,
        "passed": bool(passed),
        "values": _finite(values),
        "version": qwenkit.__version__,
        "timestamp": now(),
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def read_metrics(out_dir: str | Path) -> dict[str, Any] | None:
    """A notebook's ``metrics.json`` (None when the notebook never wrote one)."""
    path = Path(out_dir) / METRICS_FILE
    return json.loads(path.read_text()) if path.is_file() else None
