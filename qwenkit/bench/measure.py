"""Measurement primitives shared by notebook 04 and ``benchmarks/``: the matmul peak, one loss-head
case, and a measurement in a fresh process.

A loss-head case (lm_head + cross-entropy forward and backward, full logits or chunked, at one
shape) runs in a **fresh process** (``python -m qwenkit.bench.measure CASE_JSON``), so the
peak memory it reports is the head's own: on CPU the peak RSS (VmHWM, reset through
``/proc/self/clear_refs`` once the inputs exist), on an accelerator the allocator's peak. A case
may hold several variants (full and chunked, or chunk sizes): each one's first pass gives its
memory, then their timed passes alternate, so a comparison of times is not a comparison of two
moments of a shared machine's load. Kept apart from :mod:`qwenkit.notebooks.perf` so that tests and
benchmarks need neither plotly nor the notebook extra.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from qwenkit.device import CPU_MALLOC_ENV, memory_bytes, reset_peak_memory
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX, auto_chunk_size, chunked_linear_cross_entropy

MiB = 2**20
MAX_ROUNDS = 50  # timed rounds of one case at most, however cheap its passes


def repeat(run: Callable[[], float], repeats: int, min_time_s: float, cap: int) -> int:
    """Call ``run`` (which returns the seconds it took) at least ``repeats`` times, then more until
    those seconds add up to ``min_time_s`` (``cap`` calls at most); returns the number of calls.

    A cheap measurement's few passes can all fall into one busy moment of a shared machine; a
    minimum time spreads them over many scheduler periods.
    """
    calls, spent = 0, 0.0
    while calls < repeats or (spent < min_time_s and calls < cap):
        spent += run()
        calls += 1
    return calls


def use_cpu_threads(device: torch.device, threads: int) -> int:
    """On CPU with ``threads > 0``, run this process's torch ops on that many threads; returns the
    number in use. On 2 busy cores every operator of a 2-thread pass waits for its slowest thread
    (a model step measured 1,106 ms instead of ~17), so notebook 04 measures with one thread, as
    each CPU rank of ``qwenkit train`` runs."""
    if device.type == "cpu" and threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


# ---------------------------------------------------------------------------------------------
# Matmul peak


def matmul_peak(
    device: torch.device, dtype: torch.dtype, size: int = 4096, repeats: int = 5, min_time_s: float = 0.5
) -> dict[str, Any]:
    """Best achieved FLOP/s of a square ``size`` GEMM: the ceiling MFU is measured against.

    ``benchmarks/train_step.py`` measures its peak with this function at the same default size:
    smaller GEMMs do not reach the peak (a 1024^3 one is dominated by call overhead on a GPU).
    At least ``repeats`` passes, and more until ``min_time_s`` of them (:func:`repeat`, at most
    10,000): a 256^3 GEMM's best of 5 once measured 6 GFLOP/s instead of ~320, which put a model
    step's "MFU" above 1.
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # first call: library and allocator warm-up, not timed
    synchronize(device)
    times = []

    def gemm() -> float:
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - t0)
        return times[-1]

    passes = repeat(gemm, repeats, min_time_s, cap=10_000)
    best = min(times)
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "seconds": best,
            "flops_per_s": 2 * size**3 / best, "passes": passes}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Loss-head cases, each in a fresh process


def _head_cases(case: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the case's variants on one set of inputs in this process (the worker of :func:`head_measure`).

    First ``warmup`` untimed rounds (every variant once): they pay the first-touch page faults,
    kernel selection and the math libraries' workspaces (MKL keeps ~20 MiB of GEMM buffers after
    the first pass; in a cold process they would land in whichever variant runs first). Then each
    variant's memory pass, one at a time, from what the process holds once the previous variant's
    gradients are dropped (its ``[N, V]`` and ``[C, V]`` buffers are mmapped under
    ``CPU_MALLOC_ENV`` and go back to the OS when freed; an accelerator's allocated bytes count
    only live tensors), so the order does not change a peak. Then timed rounds in which every
    variant runs once, the order reversed every other round:
    the variants share whatever load the machine has, pass by pass, instead of each meeting its
    own minutes of it. Cheap cases run more rounds (until ``min_time_s`` of timed passes,
    ``MAX_ROUNDS`` at most), so their medians rest on more passes than the long ones'.
    """
    import torch.nn.functional as F
    from transformers.loss.loss_utils import ForCausalLMLoss

    if case["device"].startswith("npu"):
        import torch_npu  # noqa: F401  (registers the npu device type in this fresh process)
    device = torch.device(case["device"])
    use_cpu_threads(device, case["threads"])
    dtype = getattr(torch, case["dtype"])
    n, h, v = case["seq_len"], case["hidden"], case["vocab"]
    torch.manual_seed(0)
    # initialised in place, so no temporary inflates the baseline
    weight = torch.empty(v, h, device=device, dtype=dtype).normal_().mul_(0.02).requires_grad_()  # [V, H]
    hidden = torch.empty(1, n, h, device=device, dtype=dtype).normal_().requires_grad_()  # [1, N, H]
    labels = torch.randint(0, v, (1, n), device=device)
    labels[:, : round(n * case.get("ignored", 0.25))] = IGNORE_INDEX  # a prompt (and image) that is not learned
    skip = case.get("skip_ignored", True)
    rows = int((labels[:, 1:] != IGNORE_INDEX).sum()) if skip else n  # the rows the chunked head projects

    def head(variant: str):
        """(chunk size or None, the forward+backward of this head)."""
        if variant == "full":  # HF's own head: lm_head logits [1, N, V], then its causal-LM loss
            return None, lambda: ForCausalLMLoss(F.linear(hidden, weight), labels, vocab_size=v)
        chunk = auto_chunk_size(rows, v, case.get("budget_mb", 512) * MiB) if variant == "auto" else int(variant)
        return chunk, lambda: chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, skip_ignored=skip)

    variants = case["variants"]
    heads = {var: head(var) for var in variants}

    def one_pass(var: str) -> float:
        synchronize(device)
        t0 = time.perf_counter()
        heads[var][1]().backward()
        synchronize(device)
        seconds = time.perf_counter() - t0
        weight.grad = hidden.grad = None  # the next pass, or the next variant's baseline, starts without them
        return seconds

    for _ in range(case["warmup"]):  # before the baseline: the libraries' one-time buffers are nobody's peak
        for var in variants:
            one_pass(var)
    peaks, times = {}, {var: [] for var in variants}
    for var in variants:
        synchronize(device)
        base = memory_bytes(device, peak=False)  # CPU: resident set; accelerator: live tensors
        reset_peak_memory(device)  # CPU: VmHWM := current RSS
        first = one_pass(var)
        peaks[var] = memory_bytes(device, peak=True) - base
        if not case["repeats"]:
            times[var].append(first)  # no timed rounds asked for: the memory pass is the time

    def one_round() -> float:  # every variant once, the order reversed every other round
        order = variants if len(times[variants[0]]) % 2 == 0 else variants[::-1]
        seconds = {var: one_pass(var) for var in order}
        for var, s in seconds.items():
            times[var].append(s)
        return sum(seconds.values())

    if case["repeats"]:
        repeat(one_round, case["repeats"], case["min_time_s"], cap=MAX_ROUNDS)
    shape = {k: val for k, val in case.items() if k != "variants"}
    # the median is the point; min and max are its spread, drawn as error bars
    return [{**shape, "variant": var, "chunk_size": heads[var][0], "passes": len(times[var]),
             "time_ms": 1e3 * statistics.median(times[var]), "time_min_ms": 1e3 * min(times[var]),
             "time_max_ms": 1e3 * max(times[var]), "peak_mb": peaks[var] / MiB} for var in variants]  # fmt: skip


def fresh_process(
    args: list[str],
    what: str,
    timeout_s: float | None = None,
    allocator: dict[str, str] = CPU_MALLOC_ENV,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> dict[str, Any]:
    """``python ARGS`` in a fresh process, so its peak memory is its own; its last stdout line, as JSON.

    It runs with the allocator setting ``qwenkit train`` gives CPU ranks (``allocator``; the
    caller's environment wins), so every measured variant allocates alike; ``env`` adds variables
    (e.g. ``PYTHONPATH`` of another source tree) and ``cwd`` sets its folder. ``what`` names it in
    the error raised when it fails. Every benchmark that measures in a fresh process uses this.
    """
    env = {**allocator, **os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout_s, cwd=cwd)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def head_measure(case: dict[str, Any], timeout_s: float = 600) -> list[dict[str, Any]]:
    """A loss-head case (:func:`head_case`) in a fresh Python process; one result row per variant."""
    return fresh_process(["-m", "qwenkit.bench.measure", json.dumps(case)], f"loss-head case {case}", timeout_s)


def head_case(variants, seq_len, hidden, vocab, dtype="float32", device="cpu", repeats=0, ignored=0.25,
              skip_ignored=True, warmup=0, min_time_s=0.0, threads=0) -> dict[str, Any]:  # fmt: skip
    """The description of a loss-head case, as :func:`head_measure` takes it.

    ``variants``: ``"full"`` (HF's head), a chunk size, ``"auto"``, or a list of them, measured on
    the same inputs in one process with their timed passes interleaved (a list needs ``warmup``
    >= 1). ``warmup``: untimed rounds before the memory passes; ``repeats``: timed rounds after
    them (0: each variant's time is its memory pass, the benchmarks' cold pass); ``min_time_s``:
    more rounds, up to ``MAX_ROUNDS``, until the timed passes add up to this. ``ignored``: the
    leading share of positions whose label is -100 (a prompt); ``skip_ignored``: the chunked head
    projects only labelled rows (False: every row, the dense reference). ``threads``: CPU threads
    of the measuring process (0: torch's default, every core).
    """
    case = {
        "ignored": float(ignored),
        "skip_ignored": bool(skip_ignored),
        "variants": [str(x) for x in (variants if isinstance(variants, (list, tuple)) else [variants])],
        "seq_len": int(seq_len),
        "hidden": int(hidden),
        "vocab": int(vocab),
        "dtype": dtype,
        "device": str(device),
        "repeats": int(repeats),
        "warmup": int(warmup),
        "min_time_s": float(min_time_s),
        "threads": int(threads),
    }
    if len(case["variants"]) > 1 and case["warmup"] < 1:
        raise ValueError(f"head_case: variants {case['variants']} share a process; their peaks compare only after "
                         "a warm-up round (warmup >= 1), else the first carries the libraries' one-time buffers")  # fmt: skip
    return case


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m qwenkit.bench.measure CASE_JSON   (a loss-head case; see head_case)", file=sys.stderr)
        return 2
    print(json.dumps(_head_cases(json.loads(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
