"""The long-format result row: one measured number with what it is and where it came from.

::

    metric, unit, series, x_name, x, value, device, version, timestamp

``series`` names the variant a number belongs to (``"rank 0"``, ``"chunk 64"``,
``"image-text/token_mean"``), ``x_name``/``x`` the swept quantity (``"step"``, ``12``;
``"seq_len"``, ``2048``). Training metrics (:class:`qwenkit.engine.metrics.MetricsWriter`, one
JSONL file per rank, plus a ``rank`` field) and the notebooks' result files
(:mod:`qwenkit.notebooks.results`, CSV) are both written from :func:`record`, so one reader and
one set of figures serve both. Timestamps are UTC ISO 8601 with milliseconds.
"""

from __future__ import annotations

import datetime
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
