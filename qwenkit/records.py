"""The long-format result row: one measured number with what it is and where it came from.

::

    metric, unit, series, x_name, x, value, device, version, timestamp

``series`` names the variant a number belongs to (``"rank 0"``, ``"chunk 64"``,
``"image-text/token_mean"``), ``x_name``/``x`` the swept quantity (``"step"``, ``12``;
``"seq_len"``, ``2048``). Training metrics (:class:`qwenkit.engine.run.metrics.MetricsWriter`, one
JSONL file per rank, plus a ``rank`` field) and the notebooks' result files
(:mod:`qwenkit.notebooks.results`, CSV) are both written from :func:`record`, so one reader and
one set of figures serve both. Timestamps are UTC ISO 8601 with milliseconds (:func:`now`, every
file qwenkit writes). Every JSON-lines file qwenkit reads goes through :func:`read_jsonl`.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import qwenkit

FIELDS = ("metric", "unit", "series", "x_name", "x", "value", "device", "version", "timestamp")


def now() -> str:
    """UTC now, ISO 8601 with milliseconds (``2025-01-01T12:00:00.123+00:00``)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def record(
    metric: str,
    value: float,
    *,
    unit: str = "",
    series: str = "",
    x_name: str = "",
    x: float | int | str | None = None,
    device: str = "cpu",
    timestamp: str | None = None,
) -> dict[str, Any]:
    """One long-format row; ``version`` is qwenkit's, ``timestamp`` UTC now unless given."""
    return {
        "metric": metric,
        "unit": unit,
        "series": series,
        "x_name": x_name,
        "x": "" if x is None else x,
        "value": float(value),
        "device": device,
        "version": qwenkit.__version__,
        "timestamp": timestamp or now(),
    }


def parse_jsonl(text: str, name: str, skip_bad: bool = False) -> list[dict[str, Any]]:
    """The rows of JSON-lines ``text`` (``name``: the file, for errors), blank lines skipped.

    A last line without its newline that does not parse is a writer still writing, or killed: it
    is left out. Another line that does not parse is an error naming the file and the line, unless
    ``skip_bad`` (a stream that a crashed writer may have cut mid-line before the next appended).
    """
    rows = []
    lines = text.split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines) or skip_bad:
                continue
            raise ValueError(f"{name}: line {number} is not JSON: {e}") from None
    return rows


def read_jsonl(path: str | Path, skip_bad: bool = False) -> list[dict[str, Any]]:
    """:func:`parse_jsonl` of a file."""
    return parse_jsonl(Path(path).read_text(), str(path), skip_bad)


def append_jsonl(path: str | Path, row: dict[str, Any], sync: bool = False) -> None:
    """Append one row as one line (one ``write``); ``sync``: fsync it (a killed writer loses nothing it reported)."""
    with Path(path).open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        if sync:
            os.fsync(f.fileno())
