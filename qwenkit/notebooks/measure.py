"""Measurement primitives shared by notebook 04 and ``benchmarks/``: the matmul peak, one loss-head
case, and a measurement in a fresh process.

A loss-head case (lm_head + cross-entropy forward and backward, full logits or chunked) runs in
a **fresh process** (``python -m qwenkit.notebooks.measure CASE_JSON``), so its peak memory is
its own: on CPU the peak RSS (VmHWM, reset through ``/proc/self/clear_refs`` once the inputs
exist), on an accelerator the allocator's peak. The first pass gives the memory, the next
``repeats`` passes the time. Kept apart from :mod:`qwenkit.notebooks.perf` so that tests and
benchmarks need neither plotly nor the notebook extra.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from qwenkit.launch import CPU_MALLOC_ENV
from qwenkit.loss import IGNORE_INDEX, auto_chunk_size, chunked_linear_cross_entropy

MiB = 2**20


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


# ---------------------------------------------------------------------------------------------
# Matmul peak


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int = 4096, repeats: int = 5) -> dict[str, Any]:
    """Best achieved FLOP/s of a square ``size`` GEMM: the ceiling MFU is measured against.

    ``benchmarks/train_step.py`` measures its peak with this function at the same default size:
    smaller GEMMs do not reach the peak (a 1024^3 one is dominated by call overhead on a GPU).
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # first call: library and allocator warm-up, not timed
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    flops = 2 * size**3
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "seconds": best, "flops_per_s": flops / best}


# ---------------------------------------------------------------------------------------------
# Loss-head cases, each in a fresh process


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _head_case(case: dict[str, Any]) -> dict[str, Any]:
    """Run one loss-head case in this process (the worker side of :func:`head_measure`)."""
    import torch.nn.functional as F
    from transformers.loss.loss_utils import ForCausalLMLoss

    if case["device"].startswith("npu"):
        import torch_npu  # noqa: F401  (registers the npu device type in this fresh process)
    device = torch.device(case["device"])
    dtype = getattr(torch, case["dtype"])
    n, h, v = case["seq_len"], case["hidden"], case["vocab"]
    torch.manual_seed(0)
    # initialised in place, so no temporary inflates the baseline
    weight = torch.empty(v, h, device=device, dtype=dtype).normal_().mul_(0.02).requires_grad_()  # [V, H]
    hidden = torch.empty(1, n, h, device=device, dtype=dtype).normal_().requires_grad_()  # [1, N, H]
    labels = torch.randint(0, v, (1, n), device=device)
    labels[:, : round(n * case.get("ignored", 0.25))] = IGNORE_INDEX  # a prompt (and image) that is not learned
    skip = case.get("skip_ignored", True)
    variant = case["variant"]
    if variant == "full":
        chunk = None

        def loss_fn():  # HF's own head: lm_head logits [1, N, V], then its causal-LM loss
            return ForCausalLMLoss(F.linear(hidden, weight), labels, vocab_size=v)

    else:
        rows = int((labels[:, 1:] != IGNORE_INDEX).sum()) if skip else n  # the rows the head projects
        chunk = auto_chunk_size(rows, v, case.get("budget_mb", 512) * MiB) if variant == "auto" else int(variant)

        def loss_fn():
            return chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, skip_ignored=skip)

    def one_pass() -> float:
        weight.grad = hidden.grad = None
        synchronize(device)
        t0 = time.perf_counter()
        loss_fn().backward()
        synchronize(device)
        return time.perf_counter() - t0

    if device.type == "cpu":
        base = status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        first = one_pass()
        peak = status_bytes("VmHWM") - base
    else:
        synchronize(device)
        memory = torch.get_device_module(device.type)  # torch.accelerator's memory calls need torch 2.8+
        base = memory.memory_allocated(device)
        memory.reset_peak_memory_stats(device)
        first = one_pass()
        peak = memory.max_memory_allocated(device) - base
    times = [1e3 * t for t in ([one_pass() for _ in range(case["repeats"])] or [first])]
    # the median is the point; min and max are its spread, drawn as error bars
    return {**case, "chunk_size": chunk, "time_ms": statistics.median(times), "time_min_ms": min(times),
            "time_max_ms": max(times), "peak_mb": peak / MiB}  # fmt: skip


def fresh_process(args: list[str], what: str, timeout_s: float | None = None) -> dict[str, Any]:
    """``python ARGS`` in a fresh process, so its peak memory is its own; its last stdout line, as JSON.

    It runs with the allocator setting ``qwenkit train`` gives CPU ranks (unless the caller's
    environment sets it), so every measured variant allocates alike. ``what`` names it in the
    error raised when it fails.
    """
    env = {**CPU_MALLOC_ENV, **os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def head_measure(case: dict[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    """One loss-head case in a fresh Python process; its result row."""
    return fresh_process(["-m", "qwenkit.notebooks.measure", json.dumps(case)], f"loss-head case {case}", timeout_s)


def head_case(variant, seq_len, hidden, vocab, dtype="float32", device="cpu", repeats=0, ignored=0.25,
              skip_ignored=True) -> dict[str, Any]:  # fmt: skip
    """The description of one loss-head case, as :func:`head_measure` takes it.

    ``ignored``: the leading share of positions whose label is -100 (a prompt); ``skip_ignored``:
    the chunked head projects only labelled rows (False: every row, the dense reference).
    """
    return {
        "ignored": float(ignored),
        "skip_ignored": bool(skip_ignored),
        "variant": str(variant),
        "seq_len": int(seq_len),
        "hidden": int(hidden),
        "vocab": int(vocab),
        "dtype": dtype,
        "device": str(device),
        "repeats": int(repeats),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m qwenkit.notebooks.measure CASE_JSON   (one loss-head case; see head_measure)", file=sys.stderr)
        return 2
    print(json.dumps(_head_case(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
