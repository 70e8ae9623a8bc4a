"""Qwen3.5's MTP layer trained beside the model (``model.mtp.train``) vs left as the base checkpoint had it.

``params/tiny_mtp_cpu.yaml`` (the tiny Qwen3.5, random init, its checkpoint's ``mtp.*`` layer; 2 gloo ranks,
FSDP2, the chunked head) is fine-tuned twice from the same base with the same seed and data, each run in
its own ``qwenkit train`` process:

- ``off``: ``model.mtp.train=false``, the baseline: the MTP layer is not run; the export carries it unchanged;
- ``on``: ``model.mtp.train=true``: its loss (weight ``model.mtp.loss_weight``) beside the main one.

Per run it prints the MTP acceptance (``qwenkit eval RUN --metric mtp_acceptance``: the fraction of
held-out reply positions where the MTP layer's top-1 draft equals the model's greedy token) before (the
base's, the on-run's step-0 eval) and after, the main loss (the last eval_loss, which has no MTP term, and the
last step's training loss without it), the mean step time after the first ``--skip`` steps and the peak memory
(CPU: the rank's peak RSS), and ``on``'s ratio to ``off`` for the last two. Results append to
``benchmarks/results/mtp_cpu.jsonl``.

    flock /tmp/qwenkit-bench.lock python benchmarks/mtp.py            # 2 x 150 steps, ~3-4 min on 2 cores
    python benchmarks/mtp.py --steps 40                               # quicker look
    python benchmarks/mtp.py --order on,off                            # the other variant first
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from qwenkit.engine.run import metrics

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "params" / "tiny_mtp_cpu.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "mtp_cpu.jsonl"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _qwenkit(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "qwenkit.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"qwenkit {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def _acceptance(target: Path) -> float:
    return float(re.search(r"^mtp_acceptance ([0-9.]+) ", _qwenkit("eval", str(target), "--metric", "mtp_acceptance"), re.M)[1])


def run(variant: str, out: Path, args) -> dict:
    on = variant == "on"
    _qwenkit("train", "--config", str(RECIPE), "--master-port", str(_port()), f"model.mtp.train={str(on).lower()}",
             f"train.steps={args.steps}", f"train.eval_every={args.steps}", f"train.output_dir={out}", "train.resume=none")  # fmt: skip
    rows = metrics.read(out)
    last = args.steps
    loss = metrics.series(rows, "loss")[last]
    mtp = metrics.series(rows, "mtp_loss").get(last)
    times = [v for s, v in metrics.series(rows, "step_time").items() if s > args.skip]
    peak = max(r["value"] for r in rows if r["metric"] == "peak_memory")
    return {
        "variant": variant, "steps": last,
        "acceptance_before": metrics.series(rows, "eval_mtp_acceptance").get(0), "acceptance_after": _acceptance(out),
        "logged_acceptance_after": metrics.series(rows, "eval_mtp_acceptance").get(last),
        "eval_loss": metrics.series(rows, "eval_loss")[last], "main_loss": loss - (args.weight * mtp if on else 0.0),
        "mtp_loss": mtp, "step_time_s": statistics.mean(times), "peak_mib": peak,
    }  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--skip", type=int, default=5, help="first steps left out of the mean step time")
    p.add_argument("--weight", type=float, default=0.1, help="the recipe's model.mtp.loss_weight")
    p.add_argument("--order", choices=("off,on", "on,off"), default="off,on",
                   help="which run goes first (an order effect in the step time shows as a ratio that flips)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qwenkit-mtp-") as tmp:
        results = {v: run(v, Path(tmp) / v, args) for v in args.order.split(",")}
        results = {v: results[v] for v in ("off", "on")}
    results["on"]["acceptance_before"] = results["off"]["acceptance_before"] = results["on"]["acceptance_before"]
    for key in ("step_time_s", "peak_mib"):
        results["on"][key.split("_")[0] + "_ratio"] = results["on"][key] / results["off"][key]
    print(f"{'variant':8} {'accept before':>13} {'accept after':>12} {'eval_loss':>9} {'main loss':>9} {'mtp_loss':>8} "
          f"{'step s':>7} {'peak MiB':>8}  ratios (on/off)")  # fmt: skip
    for r in results.values():
        mtp = f"{r['mtp_loss']:8.4f}" if r["mtp_loss"] is not None else f"{'-':>8}"
        ratio = f"  time {r['step_ratio']:.2f}x, peak {r['peak_ratio']:.2f}x" if "step_ratio" in r else "  (baseline)"
        print(f"{r['variant']:8} {r['acceptance_before']:13.4f} {r['acceptance_after']:12.4f} {r['eval_loss']:9.4f} "
              f"{r['main_loss']:9.4f} {mtp} {r['step_time_s']:7.3f} {r['peak_mib']:8.0f}{ratio}")  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("a") as f:
        for r in results.values():
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
