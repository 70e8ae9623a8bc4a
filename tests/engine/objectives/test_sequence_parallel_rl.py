"""GRPO's and DPO's training forwards under Ulysses sequence parallelism (``parallel.sp_size: 2``): 2 gloo ranks in
one SP group train as one process on the same global batch, through ``qwenkit train``, padded and packed.

GRPO: the rollouts stay whole (each rank of the group generates, the group trains on its first rank's); the old,
the current and the reference log-probs (the policy with its adapters off, or the frozen copy on the same slices)
come from each rank's slice, gathered over the group (``qwenkit.model.parallel.token_logps_slice``); every rank
takes the whole loss with its gradient through its own slice.
DPO: every chosen and rejected row's per-sequence log-prob sum is that of its per-token log-probs gathered once
over the group, for the policy and its reference (the frozen copy, the policy with its adapters off, or the
precompute pass's table); the length-normalised losses (IPO, SimPO) divide by the whole row's counts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from multiproc import free_port, scaled

from qwenkit.engine.objectives.dpo import METRICS

ROOT = Path(__file__).resolve().parents[3]
KEYS = ["train.objective=grpo", "grpo.num_generations=3", "grpo.max_new_tokens=6", "grpo.beta=0.04",
        "grpo.num_iterations=2", "grpo.rewards=[engine.objectives.test_packed_rl:vowels]", "train.steps=2",
        "train.micro_batch_size=2", "data.tiny_samples=8", "data.tiny_eval_samples=4", "train.resume=none", "checkpoint.save_final=false",
        "train.max_grad_norm=0", "train.warmup_steps=0", "train.lr=0.01", "parallel.allow_oversubscribe=true"]  # fmt: skip
COMPARED = ("loss", "grad_norm", "reward", "kl", "entropy", "clip_ratio/region_mean", "completions/mean_length")


def _run(out: Path, nproc: int, *overrides, keys=KEYS) -> dict[int, dict[str, float]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))  # the tests' reward
    proc = subprocess.run([sys.executable, "-m", "qwenkit.cli", "train", "--nproc", str(nproc), "--master-port",
                           str(free_port()), *keys, *overrides, f"train.output_dir={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=scaled(600), env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logged: dict[int, dict[str, float]] = {}
    for line in (out / "metrics" / "rank-00000.jsonl").read_text().splitlines():
        row = json.loads(line)
        logged.setdefault(row["x"], {})[row["metric"]] = row["value"]
    return logged


@pytest.mark.slow
# packed: the same forward on a packed row (positions per sample), in the long tier (two more runs, ~1.5 min);
# the high-entropy tokens through the trainer (that each token counts once is test_policy.py's SP-group test: these
# tokens' threshold happens to mask the same with every rank counting)
@pytest.mark.parametrize("packing, quantile", [("false", "1.0"), pytest.param("true", "1.0", marks=pytest.mark.long),
                                               pytest.param("false", "0.2", marks=pytest.mark.long)])  # fmt: skip
def test_grpo_with_sp_size_2_logs_the_one_process_losses_and_gradient_norms(tmp_path, packing, quantile):
    keys = [f"data.packing={packing}", f"grpo.top_entropy_quantile={quantile}"]
    one = _run(tmp_path / "one", 1, *keys)
    sp2 = _run(tmp_path / "sp2", 2, "parallel.sp_size=2", *keys)
    assert sorted(sp2) == sorted(one) == [0, 1, 2]  # step 0: the held-out evaluation before training
    assert one[2]["loss"] != 0 and one[2]["kl"] > 0  # step 2 reuses the rollout: its old log-probs and the KL count
    for step in (1, 2):
        for key in COMPARED:
            assert sp2[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-6), (step, key)
    for step in (0, 2):  # the eval rows' loss on the group's slices, and their greedy replies
        for key in ("eval_loss", "eval_accuracy"):
            assert sp2[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-6), (step, key)


DPO = ["train.objective=dpo", "data.tiny_samples=8", "data.tiny_eval_samples=4", "train.steps=2", "train.grad_accum=2",
       "train.micro_batch_size=2", "train.resume=none", "checkpoint.save_final=false", "train.max_grad_norm=0",
       "train.warmup_steps=0", "train.lr=0.01", "parallel.allow_oversubscribe=true"]  # fmt: skip
DPO_COMPARED = ("loss", "grad_norm", *METRICS)  # and every eval_ metric (steps 0 and 2: held-out pairs on slices)
LORA = ["lora.r=4", "lora.alpha=8"]


@pytest.mark.slow
@pytest.mark.parametrize("loss, packing, reference", [
    ("sigmoid", "false", "copy"),
    ("ipo", "true", "adapters"),
    # in the long tier (~1 min each): the other layout of each loss, the precompute pass on slices, SimPO
    pytest.param("sigmoid", "true", "precomputed", marks=pytest.mark.long),
    pytest.param("ipo", "false", "copy", marks=pytest.mark.long),
    pytest.param("simpo", "true", "none", marks=pytest.mark.long),
])  # fmt: skip
def test_dpo_with_sp_size_2_logs_the_one_process_losses_gradient_norms_and_rewards(tmp_path, loss, packing, reference):
    runs = {}
    for name, nproc, extra in (("one", 1, []), ("sp2", 2, ["parallel.sp_size=2"])):
        keys = [*DPO, f"dpo.loss={loss}", f"data.packing={packing}", *extra, *(LORA if reference == "adapters" else [])]
        if reference == "precomputed":  # each run's own table, written by its own pass
            keys += ["dpo.precompute_ref=true", f"data.cache_dir={tmp_path / name / 'cache'}"]
        runs[name] = _run(tmp_path / name, nproc, keys=keys)
    one, sp2 = runs["one"], runs["sp2"]
    assert sorted(sp2) == sorted(one) == [0, 1, 2]  # step 0: the evaluation before training
    assert one[2]["rewards/margins"] != 0 and one[2]["loss"] != one[1]["loss"]  # step 2 trained on step 1's update
    for step in (1, 2):
        for key in DPO_COMPARED:
            assert sp2[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-6), (step, key)
    for step in (0, 2):
        evals = [k for k in one[step] if k.startswith("eval_")]
        assert len(evals) == len(METRICS) + 1, evals
        for key in evals:
            assert sp2[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-6), (step, key)
