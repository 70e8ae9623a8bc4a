"""The day a GPU is lent: every CUDA check of the kit in one run (~10 min on one GPU), a JSON summary.

Each check runs in its own process with its own time limit, so one that hangs or fails does not stop
the others; the summary (``--out``, default ``gpu-check.json``) holds, per check, ``status``
(passed | failed | skipped | timeout), seconds, the last lines of its output and its numbers:

- ``cuda_tests``: ``pytest -m cuda`` (Liger's routes, flash-linear-attention and causal-conv1d on packed
  rows, NCCL runs, ...): passed / failed / skipped counts from its JUnit file;
- ``chunk_vs_hf_bf16``: the chunked loss head against full logits in bf16 on the GPU, loss and both
  gradients (relative errors; bf16's tolerance);
- ``mfu_3b``: a Qwen2.5-VL-3B-shaped training step (``benchmarks/train_step.py --shapes 3b``, the chunk
  variant): step time, peak memory, MFU against the GPU's own GEMM peak;
- ``vllm``: the vLLM tests (greedy = the kit's, the push, a GRPO run with vLLM rollouts) on the GPU,
  skipped where vLLM is not installed.

    python benchmarks/gpu_check.py --out $OUT/gpu-check.json        # make gpu-check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMITS = {"cuda_tests": 210, "chunk_vs_hf_bf16": 45, "mfu_3b": 150, "vllm": 180}  # seconds: under 10 min in all

CHUNK_VS_HF = """
import json, torch
from qwenkit.model.losses.cross_entropy import chunked_linear_cross_entropy, full_cross_entropy
torch.manual_seed(0)
h = (torch.randn(2, 2048, 2048, device="cuda") * 0.5).bfloat16().requires_grad_()
w = (torch.randn(151936, 2048, device="cuda") * 0.02).bfloat16().requires_grad_()
labels = torch.randint(0, 151936, (2, 2048), device="cuda"); labels[:, :512] = -100
out = {}
for name in ("chunk", "hf"):
    h.grad = w.grad = None
    loss = chunked_linear_cross_entropy(h, w, labels) if name == "chunk" else full_cross_entropy(h @ w.T, labels)
    loss.backward()
    out[name] = (loss.detach().float(), h.grad.float(), w.grad.float())
rel = lambda a, b: ((a - b).norm() / b.norm()).item()
print(json.dumps({"loss_rel": rel(out["chunk"][0], out["hf"][0]), "grad_hidden_rel": rel(out["chunk"][1], out["hf"][1]),
                  "grad_weight_rel": rel(out["chunk"][2], out["hf"][2])}))
"""


def run(name: str, cmd: list[str], out_dir: Path) -> dict:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMITS[name])
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-2000:]
        return {"status": "timeout", "seconds": round(time.perf_counter() - t0, 1), "tail": str(tail)}
    (out_dir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    return {"status": "passed" if proc.returncode == 0 else "failed", "seconds": round(time.perf_counter() - t0, 1),
            "tail": (proc.stdout + proc.stderr)[-2000:], "stdout": proc.stdout}  # fmt: skip


def junit_counts(path: Path) -> dict:
    if not path.is_file():
        return {}
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu-check.json", help="the JSON summary (logs beside it)")
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    summary = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "torch": torch.__version__, "checks": {}}  # fmt: skip
    if not torch.cuda.is_available():
        summary["checks"] = {name: {"status": "skipped", "why": "no CUDA device"} for name in LIMITS}
        out.write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary))
        return 1
    py = sys.executable
    junit = out.parent / "cuda-tests.xml"
    checks = summary["checks"]
    checks["cuda_tests"] = run("cuda_tests", [py, "-m", "pytest", "-q", "-m", "cuda", f"--junitxml={junit}", "tests"], out.parent)
    checks["cuda_tests"] |= junit_counts(junit)
    c = run("chunk_vs_hf_bf16", [py, "-c", CHUNK_VS_HF], out.parent)
    if c["status"] == "passed":
        c |= json.loads(c["stdout"].strip().splitlines()[-1])
        c["status"] = "passed" if max(c["loss_rel"], c["grad_hidden_rel"], c["grad_weight_rel"]) < 2e-2 else "failed"
    checks["chunk_vs_hf_bf16"] = c
    rows = out.parent / "mfu-3b.jsonl"
    m = run("mfu_3b", [py, "benchmarks/train_step.py", "--device", "cuda", "--shapes", "3b", "--variants", "chunk",
                       "--steps", "3", "--out", str(rows)], out.parent)  # fmt: skip
    if rows.is_file():
        r = json.loads(rows.read_text().splitlines()[-1])
        m |= {k: r.get(k) for k in ("step_s", "peak_bytes", "mfu", "tokens")}
    checks["mfu_3b"] = m
    if importlib.util.find_spec("vllm") is None:
        checks["vllm"] = {"status": "skipped", "why": "vllm is not installed (pip install -e '.[cuda,vllm]')"}
    else:
        vjunit = out.parent / "vllm-tests.xml"
        checks["vllm"] = run("vllm", [py, "-m", "pytest", "-q", f"--junitxml={vjunit}",
                                      "tests/engine/generation/test_vllm_engine.py", "tests/engine/rollouts/test_vllm.py"],
                             out.parent) | junit_counts(vjunit)  # fmt: skip
    for c in checks.values():
        c.pop("stdout", None)
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: {"status": v["status"], "seconds": v.get("seconds")} for k, v in checks.items()}))
    return 0 if all(v["status"] in ("passed", "skipped") for v in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
