"""A sweep file over the tiny model (one rank, a few steps), and ``qwenkit`` run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


# 1 rank, a few steps of 4 rows, a 4-row eval set (2 of them generated for accuracy)
SMALL = ["parallel.nproc=1", "train.steps=4", "train.micro_batch_size=4", "data.tiny_samples=16",
         "data.tiny_eval_samples=4", "train.eval_samples=2", "train.eval_every=0", "train.eval_accuracy_every=0",
         "checkpoint.every=0", "train.warmup_steps=1"]  # fmt: skip


def write_sweep(tmp_path, **spec) -> Path:
    """``tmp_path/sweep.yaml``: params/tiny_cpu.yaml with :data:`SMALL` and ``spec`` (grid, trials, seeds, ...)."""
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": str(ROOT / "params" / "tiny_cpu.yaml"), "overrides": SMALL, **spec}))
    return path


def run_qwenkit(*args, timeout=600) -> subprocess.CompletedProcess:
    """``python -m qwenkit.cli *args`` from the repository root, its output captured."""
    return subprocess.run([sys.executable, "-m", "qwenkit.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
