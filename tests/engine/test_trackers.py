"""Every metric the trainer logs reaches each tracker under a name the tracker takes, with the
JSONL's value (the JSONL is the reference)."""

from __future__ import annotations

import os

import pytest

from qwenkit import config as qconfig
from qwenkit.engine.run import metrics, train

# the README's per-module LRs, with train.no_decay: group names with '*', spaces and parentheses
GROUPS = "train.param_groups=[{pattern: model.visual.blocks.*, lr: 2.0e-6}, {pattern: model.visual.merger, lr: 1.0e-5}]"
RUN = ["train.resume=none", "data.tiny_samples=8", "data.tiny_eval_samples=2", "train.micro_batch_size=2",
       "train.steps=1", "train.eval_samples=1", "train.eval_max_new_tokens=2", "train.no_decay=true", GROUPS]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    out = tmp_path_factory.mktemp("trackers")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    trainer = train.run(qconfig.load(overrides=[*RUN, "train.report_to=[tensorboard, mlflow]", f"train.output_dir={out}"]))
    return out, trainer


def test_the_run_logs_every_metric_the_trainer_has(run):
    out, trainer = run
    logged = {r["metric"] for r in metrics.read(out / "metrics" / "rank-00000.jsonl")}
    groups = {f"lr/{g['name']}" for g in trainer.optimizer.param_groups[1:]}  # the optimizer's own names
    assert {"lr/default (no decay)", "lr/model.visual.blocks.*"} <= groups
    assert logged == set(metrics.RUN_UNITS) | groups


def test_tensorboard_holds_every_metric_of_the_jsonl(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = metrics.read(out / "metrics" / "rank-00000.jsonl")
    assert set(events.Tags()["scalars"]) == {metrics.tracker_name(r["metric"], "tensorboard") for r in rows}
    for row in rows:
        (point,) = [e for e in events.Scalars(metrics.tracker_name(row["metric"], "tensorboard")) if e.step == row["x"]]
        assert point.value == pytest.approx(row["value"], rel=1e-6), row["metric"]  # TensorBoard stores float32


def test_mlflow_holds_every_metric_of_the_jsonl(run):
    import json

    import mlflow

    out, _ = run
    saved = json.loads((out / metrics.MLFLOW_RUN_FILE).read_text())
    client = mlflow.MlflowClient(tracking_uri=saved["tracking_uri"])
    rows = metrics.read(out / "metrics" / "rank-00000.jsonl")
    names = {r["metric"] for r in rows}
    assert set(client.get_run(saved["run_id"]).data.metrics) == {metrics.tracker_name(m, "mlflow") for m in names}
    for metric in names:
        got = {m.step: m.value for m in client.get_metric_history(saved["run_id"], metrics.tracker_name(metric, "mlflow"))}
        assert got == metrics.series(rows, metric), metric


@pytest.mark.parametrize("metric", ["lr/model.visual.blocks.*", "lr/default (no decay)", "lr/a//b", "lr/./x", "lr/../x",
                                    "lr/x/", "/lr", "lr/Ünïcode*", "lr/[a]{b}<c>?'\"|\\"])
def test_mlflow_names_pass_mlflow_own_check_and_stay_stable(metric):
    validation = pytest.importorskip("mlflow.utils.validation")
    name = metrics.tracker_name(metric, "mlflow")
    validation._validate_metric_name(name)  # raises MlflowException for a name MLflow refuses
    assert metrics.tracker_name(name, "mlflow") == name  # a valid name is left as it is
    assert metrics.tracker_name(metric, "tensorboard") == metric
    assert "/" not in name  # the file store: "lr" beside "lr/<group>" would be a file and a folder of one name


def test_two_metrics_on_one_tracker_name_are_refused():
    names = metrics._Names("mlflow")
    assert names("lr/a*") == "lr:a_"
    with pytest.raises(ValueError, match=r"metrics 'lr/a\*' and 'lr/a\?' would both be logged as 'lr:a_'"):
        names("lr/a?")


def test_two_trials_creating_one_sweep_experiment_at_once_both_log_to_it(tmp_path, monkeypatch):
    """``qwenkit sweep --parallel``: each trial looks for the sweep's experiment, finds none and creates
    it; the second create then meets the first's. Both runs land in the one experiment."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "sweep")
    for trial in ("a", "b"):
        (tmp_path / trial).mkdir()
    first = metrics.MlflowWriter(tmp_path / "a", {})
    real, looks = mlflow.MlflowClient.get_experiment_by_name, []

    def looked_too_early(self, name):  # the second trial's first look came before the first's create
        looks.append(name)
        return None if len(looks) == 1 else real(self, name)

    with monkeypatch.context() as m:
        m.setattr(mlflow.MlflowClient, "get_experiment_by_name", looked_too_early)
        second = metrics.MlflowWriter(tmp_path / "b", {})
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("sweep").experiment_id
    assert {client.get_run(w.run_id).info.experiment_id for w in (first, second)} == {experiment}
