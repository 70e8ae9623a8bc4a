"""qwenkit.records: the long-format row and the one timestamp format of every file qwenkit writes."""

from __future__ import annotations

import datetime

import qwenkit
from qwenkit import records


def test_a_record_has_every_field_and_a_utc_millisecond_timestamp():
    row = records.record("loss", 1, unit="nat", series="rank 0", x_name="step", x=3)
    assert tuple(row) == records.FIELDS and row["value"] == 1.0 and isinstance(row["value"], float)
    assert row["version"] == qwenkit.__version__ and row["device"] == "cpu"
    stamp = datetime.datetime.fromisoformat(row["timestamp"])
    assert stamp.utcoffset() == datetime.timedelta(0) and len(row["timestamp"].split(".")[1]) == len("123+00:00")
    assert records.record("x", 0, x=None)["x"] == "" and records.record("x", 0, timestamp="t")["timestamp"] == "t"
