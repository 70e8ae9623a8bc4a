"""GRPO's training forward under Ulysses sequence parallelism (``parallel.sp_size: 2``): 2 gloo ranks in one SP
group train as one process on the same global batch.

The rollouts stay whole (each rank of the group generates, the group trains on its first rank's); the old, the
current and (the policy with its adapters off) the reference log-probs come from each rank's slice, gathered over
the group (``qwenkit.model.parallel.token_logps_slice``); every rank takes the whole loss with its gradient through
its own slice. Reference: the same run on one process, padded and packed; through ``qwenkit train``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from multiproc import free_port, scaled

ROOT = Path(__file__).resolve().parents[3]
KEYS = ["train.objective=grpo", "grpo.num_generations=3", "grpo.max_new_tokens=6", "grpo.beta=0.04",
        "grpo.num_iterations=2", "grpo.rewards=[engine.objectives.test_packed_rl:vowels]", "train.steps=2",
        "train.micro_batch_size=2", "data.tiny_samples=8", "train.resume=none", "checkpoint.save_final=false",
        "train.max_grad_norm=0", "train.warmup_steps=0", "train.lr=0.01", "parallel.allow_oversubscribe=true"]  # fmt: skip
COMPARED = ("loss", "grad_norm", "reward", "kl", "entropy", "clip_ratio/region_mean", "completions/mean_length")


def _run(out: Path, nproc: int, *overrides) -> dict[int, dict[str, float]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))  # the tests' reward
    proc = subprocess.run([sys.executable, "-m", "qwenkit.cli", "train", "--nproc", str(nproc), "--master-port",
                           str(free_port()), *KEYS, *overrides, f"train.output_dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=scaled(600), env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logged: dict[int, dict[str, float]] = {}
    for line in (out / "metrics" / "rank-00000.jsonl").read_text().splitlines():
        row = json.loads(line)
        logged.setdefault(row["x"], {})[row["metric"]] = row["value"]
    return logged


@pytest.mark.slow
# packed: the same forward on a packed row (positions per sample), in the long tier (two more runs, ~1.5 min)
@pytest.mark.parametrize("packing", ["false", pytest.param("true", marks=pytest.mark.long)])
def test_grpo_with_sp_size_2_logs_the_one_process_losses_and_gradient_norms(tmp_path, packing):
    one = _run(tmp_path / "one", 1, f"data.packing={packing}")
    sp2 = _run(tmp_path / "sp2", 2, "parallel.sp_size=2", f"data.packing={packing}")
    assert sorted(sp2) == sorted(one) == [1, 2]
    assert one[2]["loss"] != 0 and one[2]["kl"] > 0  # step 2 reuses the rollout: its old log-probs and the KL count
    for step in (1, 2):
        for key in COMPARED:
            assert sp2[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-6), (step, key)
