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
peak RSS on CPU). With an eval set (:mod:`qwenkit.engine.evaluate`): ``eval_loss`` (token mean over the whole eval set) at
step 0, every ``train.eval_every`` steps and at the end, ``eval_accuracy`` (exact match) at step 0,
every ``train.eval_accuracy_every`` steps and at the end.

``train.report_to: [tensorboard]`` also writes every metric of rank 0 as a TensorBoard scalar
(tag = metric, global step = x) under ``<output_dir>/tensorboard`` (the ``tensorboard`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qwenkit import records
from qwenkit.device import memory_bytes
from qwenkit.device import reset_peak_memory as reset_device_peak

UNITS = {
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
}
REPORT_TO = ("tensorboard",)


class MetricsWriter:
    def __init__(self, output_dir: str | Path, rank: int, device: torch.device, report_to: list[str] = ()):
        self.path = Path(output_dir) / "metrics" / f"rank-{rank:05d}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.device = rank, str(device)
        self._file = open(self.path, "a")  # noqa: SIM115 - kept open for the run, closed in close()
        self._tensorboard = None
        if "tensorboard" in report_to and rank == 0:
            self._tensorboard = tensorboard_writer(Path(output_dir) / "tensorboard")

    def write(self, step: int, values: dict[str, float]) -> None:
        now = records.now()
        for metric, value in values.items():
            row = records.record(
                metric, value, unit=UNITS[metric.split("/", 1)[0]],  # lr/<group>: a parameter group's LR
                series=f"rank {self.rank}", x_name="step", x=step, device=self.device, timestamp=now,
            ) | {"rank": self.rank}
            self._file.write(json.dumps(row) + "\n")
            if self._tensorboard is not None:
                self._tensorboard.add_scalar(metric, float(value), global_step=step)
        self._file.flush()
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


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


def read(path: str | Path) -> list[dict]:
    """The rows of a run's metrics: ``path`` is a run's output_dir (every rank's file, rank by
    rank) or one rank's JSONL file. A step logged twice (resumed run) keeps both rows; a
    half-written last line (a run still writing) is left out."""
    path = Path(path)
    files = [path] if path.is_file() else sorted((path / "metrics").glob("rank-*.jsonl"))
    rows = []
    for file in files:
        with file.open() as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                if line.strip():
                    rows.append(json.loads(line))
    return rows


def series(rows: list[dict], metric: str, rank: int = 0) -> dict[int, float]:
    """``{step: value}`` of one metric on one rank; for a step logged twice (resume), the last row wins."""
    return {r["x"]: r["value"] for r in rows if r["metric"] == metric and r.get("rank", 0) == rank}


def peak_memory_mib(device: torch.device) -> float:
    """Accelerator: peak allocated since the last :func:`reset_peak_memory`; CPU: peak RSS of the process."""
    return memory_bytes(device, peak=True) / 2**20


def reset_peak_memory(device: torch.device) -> None:
    """A step's own peak on an accelerator; on CPU the metric stays the process's peak RSS (what
    the OOM killer sees), so nothing is reset there."""
    if device.type != "cpu":
        reset_device_peak(device)
