"""Per-step training metrics as JSONL, one file per rank, in long format.

Each line is one measurement::

    {"metric": "loss", "unit": "nat", "series": "rank 0", "x_name": "step", "x": 12, "value": 2.31,
     "device": "cuda:0", "version": "0.1.0", "timestamp": "2025-01-01T12:00:00.123+00:00", "rank": 0}

the long-format row of :mod:`qwenkit.records` plus ``rank``; ``x`` is the optimizer step
(1-based). Files: ``<output_dir>/metrics/rank-00000.jsonl``; a resumed
run appends, so a step repeated after a crash appears twice (readers keep the last).

Metrics per step: ``loss`` (global token/sample mean), ``grad_norm`` (before clipping), ``lr``,
``step_time``, ``tokens_per_s`` (input tokens of the global batch, padding excluded),
``samples_per_s``, ``valid_tokens`` (label tokens of the global batch), ``padding_fraction`` (pad
positions / all positions the global batch computed: 0 with ``data.packing``), ``bad_samples`` (bad
samples skipped while loading the global batch, ``data.on_bad_sample: skip``; the same on every
rank), ``peak_memory`` (this rank: accelerator peak allocated during the step, or the process's
peak RSS on CPU). With an eval set (:mod:`qwenkit.engine.generation.evaluate`): ``eval_loss`` (token mean over the whole eval set) at
step 0, every ``train.eval_every`` steps and at the end, ``eval_accuracy`` (the mean of the first of
``train.eval_metrics``; with several, each also as ``eval_accuracy/<name>``) at step 0,
every ``train.eval_accuracy_every`` steps and at the end, with ``eval_generation_time`` (seconds).

``train.report_to: [tensorboard]`` also writes every metric of rank 0 as a TensorBoard scalar
(tag = metric, global step = x) under ``<output_dir>/tensorboard`` (the ``tensorboard`` extra).
``train.report_to: [mlflow]`` logs the run's config as params and every metric of rank 0 (key =
metric, step = x) to an MLflow run (the ``mlflow`` extra, imported only then; no server): the
store is ``$MLFLOW_TRACKING_URI`` or ``file:<output_dir>/mlruns``, the experiment
``$MLFLOW_EXPERIMENT_NAME`` or the output folder's name (``qwenkit sweep`` sets both: one store
and experiment per sweep, one run per trial). ``<output_dir>/mlflow_run.json`` keeps the run id,
so a resumed run logs into the same MLflow run. The JSONL files stay the source of truth.

A tracker takes a metric under the name :func:`tracker_name` gives it, the same every time:
TensorBoard takes any tag (the JSONL name as is); MLflow allows only alphanumerics, ``_ - . :
/`` and spaces (any other character becomes ``_``, the rule of transformers' MLflow callback),
and its file store cannot hold ``lr`` beside ``lr/<group>`` (a file and a folder of one name),
so ``/`` becomes ``:``: ``lr/model.visual.blocks.*`` (a parameter group's LR) is logged as
``lr:model.visual.blocks._`` and ``lr/default (no decay)`` as ``lr:default _no decay_``.
Two metrics that would share one tracker name are refused when the second is logged.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
from pathlib import Path
from typing import Any

import torch

from qwenkit import records
from qwenkit.device import memory_bytes
from qwenkit.device import reset_peak_memory as reset_device_peak
from qwenkit.rundir import RunDir

RUN_UNITS = {  # what every run logs (evaluation's when it evaluates)
    "loss": "nat",
    "grad_norm": "1",
    "lr": "1",
    "step_time": "s",
    "tokens_per_s": "token/s",
    "samples_per_s": "sample/s",
    "valid_tokens": "token",
    "padding_fraction": "1",
    "bad_samples": "sample",
    "peak_memory": "MiB",
    "eval_loss": "nat",
    "eval_accuracy": "1",
    "eval_generation_time": "s",  # an accuracy evaluation's generation, scores and gather (engine/generation/evaluate.py)
}
# train.objective=dpo's too (TRL's names, qwenkit.engine.objectives.dpo): rewards are beta x log-ratios
PREFERENCE_UNITS = {
    "rewards": "nat", "logps": "nat", "eval_rewards": "nat", "eval_logps": "nat",
    "rewards/accuracies": "1", "eval_rewards/accuracies": "1", "logps/accuracies": "1", "eval_logps/accuracies": "1",
}
# train.objective=grpo's (TRL's names, qwenkit.engine.objectives.grpo); rewards/<name>/mean|std: see unit_of
GRPO_UNITS = {
    "reward": "1", "reward_std": "1", "frac_reward_zero_std": "1", "kl": "nat", "entropy": "nat", "clip_ratio": "1",
    "completions": "token", "completions/clipped_ratio": "1", "rollout_time": "s",
    # vLLM rollouts: the trainer's and vLLM's log-probs of the sampled tokens, and the importance weights
    **{f"sampling/sampling_logp_difference/{s}": "nat" for s in ("mean", "max")},
    **{f"sampling/importance_sampling_ratio/{s}": "1" for s in ("min", "mean", "max")},
    # a rollout's first step: the trainer's to the sampler's probability ratio, its spread (grpo_metrics.RatioSpread)
    "ratio/max_abs_dev": "1", "ratio/std": "1",
    # grpo.dynamic_sampling (qwenkit.engine.objectives.dynamic_sampling): the first draw's share, rounds, extra rows
    "dynamic_sampling/frac_reward_zero_std_drawn": "1", "dynamic_sampling/rounds": "1",
    "dynamic_sampling/extra_prompts": "sample",
    # agentic rollouts (qwenkit.engine.rollouts.agentic): calls per completion, failures per call, per-trajectory means
    "tools/call_frequency": "1", "tools/failure_frequency": "1", "tools/turns_mean": "1",
    "tools/model_tokens_mean": "token", "tools/tool_tokens_mean": "token",
}  # fmt: skip
# train.objective=distill's (qwenkit.engine.objectives.distill), beside GRPO's rollout metrics
DISTILL_UNITS = {"reverse_kl": "nat"}
# model.mtp.train's: the MTP layer's loss before its weight, its drafts accepted (engine/generation/mtp_acceptance.py)
MTP_UNITS = {"mtp_loss": "nat", "eval_mtp_acceptance": "1"}
# a MoE run's (qwenkit.engine.run.expert_load): expert_load/layer_NN, expert_load/max_over_mean
MOE_UNITS = {"expert_load": "1"}
UNITS = {**RUN_UNITS, **PREFERENCE_UNITS, **GRPO_UNITS, **DISTILL_UNITS, **MTP_UNITS, **MOE_UNITS}
_GRPO_REWARD = re.compile(r"rewards/[^/]+/(mean|std)")  # one GRPO reward's statistics (DPO's rewards/x are nats)


def unit_of(metric: str) -> str:
    """A metric's unit: its own, a GRPO reward's ("1"), else its family's (``lr/<group>``: a group's LR)."""
    if metric in UNITS:
        return UNITS[metric]
    if _GRPO_REWARD.fullmatch(metric):
        return "1"
    return UNITS[metric.split("/", 1)[0]]
REPORT_TO = ("tensorboard", "mlflow")
MLFLOW_RUN_FILE = "mlflow_run.json"
_MLFLOW_REFUSED = re.compile(r"[^0-9A-Za-z_\-. :]")  # mlflow.utils.validation (and no '/'), ASCII only


def tracker_name(metric: str, tracker: str) -> str:
    """``metric`` (a JSONL metric name) as ``tracker`` ("tensorboard" or "mlflow") can take it."""
    if tracker == "tensorboard":
        return metric
    if tracker != "mlflow":
        raise ValueError(f"unknown tracker {tracker!r}; known: {', '.join(REPORT_TO)}")
    # MLflow's file store keeps a metric as a file under its name: "lr" (a file) and "lr/<group>" (a
    # file in a folder "lr") cannot both exist there, so '/' becomes ':' (allowed, and no folder)
    name = _MLFLOW_REFUSED.sub("_", metric.replace("/", ":"))
    return name if name not in ("", ".", "..") else f"_{name}"


class _Names:
    """One tracker's names of the metrics logged so far; a second metric on one name is an error."""

    def __init__(self, tracker: str):
        self.tracker, self.seen = tracker, {}

    def __call__(self, metric: str) -> str:
        name = tracker_name(metric, self.tracker)
        first = self.seen.setdefault(name, metric)
        if first != metric:
            raise ValueError(
                f"train.report_to={self.tracker}: metrics {first!r} and {metric!r} would both be logged as "
                f"{name!r}; rename one (a train.param_groups pattern names its lr/ metric)"
            )
        return name


class MetricsWriter:
    def __init__(self, output_dir: str | Path, rank: int, device: torch.device, report_to: list[str] = (),
                 params: dict | None = None):  # fmt: skip
        self.path = Path(output_dir) / "metrics" / f"rank-{rank:05d}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.device = rank, str(device)
        self._file = open(self.path, "a")  # noqa: SIM115 - kept open for the run, closed in close()
        self._tensorboard, self._tensorboard_name = None, _Names("tensorboard")
        if "tensorboard" in report_to and rank == 0:
            self._tensorboard = tensorboard_writer(Path(output_dir) / "tensorboard")
        self._mlflow = None
        if "mlflow" in report_to and rank == 0:
            self._mlflow = MlflowWriter(Path(output_dir), params or {})

    def write(self, step: int, values: dict[str, float]) -> None:
        now = records.now()
        for metric, value in values.items():
            row = records.record(
                metric, value, unit=unit_of(metric),
                series=f"rank {self.rank}", x_name="step", x=step, device=self.device, timestamp=now,
            ) | {"rank": self.rank}
            self._file.write(json.dumps(row) + "\n")
            if self._tensorboard is not None:
                self._tensorboard.add_scalar(self._tensorboard_name(metric), float(value), global_step=step)
        self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.flush()
        if self._mlflow is not None:
            self._mlflow.log(step, values)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._mlflow is not None:
            self._mlflow.close()


def tensorboard_writer(log_dir: Path):
    """torch's SummaryWriter, imported only when asked for: the tensorboard package is an extra."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(
            f"train.report_to=[tensorboard] needs the tensorboard package ({e}); "
            "install it with `pip install qwenkit[tensorboard]`"
        ) from None
    return SummaryWriter(log_dir=str(log_dir))


class MlflowWriter:
    """One MLflow run of this output_dir (created, or found again on resume) through ``MlflowClient``."""

    def __init__(self, output_dir: Path, params: dict):
        try:
            import mlflow
            from mlflow.entities import Param
        except ImportError as e:
            raise ImportError(f"train.report_to=[mlflow] needs the mlflow package ({e}); "
                              "install it with `pip install qwenkit[mlflow]`") from None  # fmt: skip
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (output_dir.resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):
            # mlflow 3.x refuses its file store unless told: a local folder is what we want (no server, no DB)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        self.name = _Names("mlflow")
        saved = output_dir / MLFLOW_RUN_FILE
        known = json.loads(saved.read_text()) if saved.is_file() else {}
        if known.get("tracking_uri") == uri:
            self.run_id = known["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or output_dir.resolve().name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self._create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=output_dir.resolve().name).info.run_id
        flat = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
        for i in range(0, len(flat), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=flat[i:i + 100])
        saved.write_text(json.dumps({"tracking_uri": uri, "run_id": self.run_id}) + "\n")

    def _create_experiment(self, name: str) -> str:
        """The experiment's id; where a parallel trial of the same sweep created it between our look
        and this create (MLflow: RESOURCE_ALREADY_EXISTS), the one it created."""
        from mlflow.exceptions import MlflowException

        try:
            return self.client.create_experiment(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None or experiment.lifecycle_stage != "active":  # MLflow's message says what to do
                raise
            return experiment.experiment_id

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ms = int(datetime.datetime.now().timestamp() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(self.name(k), float(v), ms, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """A nested config dict as dotted keys (``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read(path: str | Path) -> list[dict]:
    """The rows of a run's metrics: ``path`` is a run's output_dir (every rank's file, rank by
    rank) or one rank's JSONL file. A step logged twice (resumed run) keeps both rows; a
    half-written last line (a run still writing) is left out."""
    path = Path(path)
    files = [path] if path.is_file() else sorted((path / "metrics").glob("rank-*.jsonl"))
    return [row for file in files for row in records.read_jsonl(file)]


def series(rows: list[dict], metric: str, rank: int = 0) -> dict[int, float]:
    """``{step: value}`` of one metric on one rank; for a step logged twice (resume), the last row wins."""
    return {r["x"]: r["value"] for r in rows if r["metric"] == metric and r.get("rank", 0) == rank}


def peak_memory_mib(device: torch.device) -> float:
    """Accelerator: peak allocated since the last :func:`start_step_peak`; CPU: peak RSS of the process."""
    return memory_bytes(device, peak=True) / 2**20


def start_step_peak(device: torch.device) -> None:
    """A step's own peak on an accelerator; on CPU the metric stays the process's peak RSS (what
    the OOM killer sees), so nothing is reset there (unlike :func:`qwenkit.device.reset_peak_memory`,
    which resets the CPU's too)."""
    if device.type != "cpu":
        reset_device_peak(device)


# A run's headline numbers (final_metrics), in the order tables show them: key -> (label, unit).
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


def final_metrics(run_dir: str | Path, wall_time: float | None = None) -> dict[str, Any]:
    """A run's headline numbers from its metrics files: the last eval loss, eval accuracy and
    training loss (rank 0; a step logged twice keeps its last row), the median tokens/s and step
    time (rank 0), the largest peak memory of any rank, the trainable parameters (the trainer's
    ``parameters.json``), the last step, and ``wall_time`` as given."""
    rows = read(run_dir)
    out: dict[str, Any] = {}
    for name in ("eval_loss", "eval_accuracy", "loss"):
        s = series(rows, name)
        out[name] = s[max(s)] if s else None
    for name in ("tokens_per_s", "step_time"):
        s = series(rows, name)
        out[name] = statistics.median(s.values()) if s else None
    peaks = [r["value"] for r in rows if r["metric"] == "peak_memory"]
    out["peak_memory"] = max(peaks) if peaks else None
    out["wall_time"] = wall_time
    counts = RunDir(run_dir).parameter_counts()
    out["trainable_params"] = counts[1] if counts else None
    steps = series(rows, "loss")
    out["steps"] = max(steps) if steps else 0
    return out
