"""Long-format result files and metrics.json round-trip."""

import json
import math

from qwenkit.notebooks import results


def test_csv_round_trip_keeps_numbers(tmp_path):
    rows = [
        results.record("time", 1.5, unit="ms", series="full", x_name="seq_len", x=256),
        results.record("time", 2.0, unit="ms", series="chunk 64", x_name="seq_len", x=512),
        results.record("passed", 1, series="text/token_mean"),
    ]
    path = results.write_csv(rows, tmp_path / "a" / "r.csv")
    back = results.read_csv(path)
    assert [r["x"] for r in back] == [256, 512, ""]
    assert [r["value"] for r in back] == [1.5, 2.0, 1.0]
    assert back[0].keys() == set(results.FIELDS)
    assert results.select(back, series="full")[0]["unit"] == "ms"


def test_metrics_json_is_strict_json(tmp_path):
    results.write_metrics(tmp_path, "03", "all good", True, max_diff=1e-7, bad=math.nan, nested={"a": math.inf})
    doc = json.loads((tmp_path / "metrics.json").read_text())  # strict parse: no NaN tokens
    assert doc["summary"] == "all good" and doc["passed"] is True
    assert doc["values"] == {"max_diff": 1e-7, "bad": None, "nested": {"a": None}}
    assert results.read_metrics(tmp_path)["notebook"] == "03"
    assert results.read_metrics(tmp_path / "missing") is None


def test_jsonl_round_trip(tmp_path):
    rows = [{"variant": "padded", "speedup": 1.0}, {"variant": "packed", "speedup": 1.38, "nested": [1, 2]}]
    path = results.write_jsonl(rows, tmp_path / "b" / "r.jsonl")
    assert results.read_jsonl(path) == rows


def test_training_metrics_and_notebook_results_write_the_same_row(tmp_path):
    """One long-format row (qwenkit.records): the trainer's JSONL is the notebooks' row plus ``rank``."""
    import datetime

    import torch

    from qwenkit.engine.run.metrics import MetricsWriter, read

    writer = MetricsWriter(tmp_path, rank=1, device=torch.device("cpu"))
    writer.write(3, {"loss": 2.5})
    writer.close()
    (trained,) = read(tmp_path)
    notebook = results.record("loss", 2.5, unit="nat", series="rank 1", x_name="step", x=3)
    assert trained.keys() == set(results.FIELDS) | {"rank"} and trained["rank"] == 1
    assert {k: trained[k] for k in results.FIELDS if k != "timestamp"} == {
        k: v for k, v in notebook.items() if k != "timestamp"
    }
    for row in (trained, notebook):  # both UTC with milliseconds (the notebooks' used to drop them)
        stamp = datetime.datetime.fromisoformat(row["timestamp"])
        assert stamp.utcoffset() == datetime.timedelta(0) and len(row["timestamp"].split(".")[1]) == len("123+00:00")
