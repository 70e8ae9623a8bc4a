"""Measurements for notebook 04: what the chunked loss head and the fused ops cost and save.

Two kinds of measurement, kept apart because they need different isolation:

- **Loss-head sweeps** (:func:`head_sweep`, :func:`chunk_sweep`): the lm_head + cross-entropy
  forward and backward at a given hidden size, vocabulary and sequence length, full logits vs
  chunked. This is the only part of a training step the two heads do differently. Each shape runs
  in a **fresh process** (``python -m qwenkit.bench.measure CASE_JSON``): every variant's
  first pass gives its peak memory (on CPU the peak RSS, on an accelerator the allocator's
  peak), then the variants' timed passes alternate, after a warm-up round, so the times
  compared met the same machine load (median, min and max of each).
- **A model training step** (:func:`time_steps`, :func:`top_ops`,
  :func:`qwenkit.bench.step.step_flops`, :func:`fused_vs_unfused`): forward, backward and AdamW
  on real batches, in this process. Model FLOPs are counted by ``torch.utils.flop_counter``
  (every matmul, attention and convolution of forward and backward; the same count as
  ``benchmarks/train_step.py``), and MFU is those FLOPs per second over a matmul peak measured
  here, in the same run (:func:`qwenkit.bench.measure.matmul_peak`), not over a datasheet number.

Heavy, long benchmarks live in ``benchmarks/``; these are sized by the notebook's parameters.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qwenkit import patches
from qwenkit.bench.measure import (  # noqa: F401 (notebook 04 calls perf.matmul_peak and perf.use_cpu_threads)
    head_case,
    head_measure,
    matmul_peak,
    use_cpu_threads,
)
from qwenkit.bench.step import mfu
from qwenkit.model.families import registry as family
from qwenkit.notebooks import plots, results
from qwenkit.patches import dispatch

STEP_FORMATS = {"flops_per_step": ".3e", "achieved_flops_per_s": ".3e", "matmul_peak_flops_per_s": ".3e",
                "mfu": ".2%", "step_ms": ".1f", "tokens_per_s": ".0f"}  # fmt: skip
OP_FORMATS = {"share": ".1%", "self_cpu_ms": ".2f", "cpu_total_ms": ".2f", "self_device_ms": ".2f"}

# The original integration's observations on Ascend, recorded by hand: reference points to
# compare against, never results of a qwenkit run.
NPU_REFERENCE = {
    "hardware": "2x Ascend 910",
    "model": "Qwen2.5-VL-3B",
    "steps": 30,
    "step_ms": {"unfused": 670.6, "fused": 629.1},  # steady-state step time
    "loss_range": (0.67, 1.21),  # loss stayed within this band over the 30 steps
    "source": "the original Qwen2.5-VL NPU integration's run notes (recorded, not re-measured)",
}


# ---------------------------------------------------------------------------------------------
# Loss-head sweeps, each case in a fresh process (qwenkit.bench.measure)


def head_sweep(seq_lens: list[int], chunk_size: int | str, hidden: int, vocab: int, **how) -> list[dict[str, Any]]:
    """Full vs chunked head at each sequence length (one process each, passes interleaved): rows
    with ``time_ms`` and ``peak_mb``. ``how``: :func:`head_case`'s dtype, device, repeats,
    min_time_s and threads."""
    rows = []
    for seq in seq_lens:
        for row in head_measure(head_case(["full", chunk_size], seq, hidden, vocab, warmup=1, **how)):
            row["head"] = "full" if row["variant"] == "full" else "chunked"
            rows.append(row)
    return rows


def chunk_sweep(seq_len: int, chunk_sizes: list[int], hidden: int, vocab: int, **how) -> list[dict[str, Any]]:
    """The chunked head at one sequence length over chunk sizes (one process, passes interleaved);
    ``how`` as for :func:`head_sweep`."""
    return head_measure(head_case(chunk_sizes, seq_len, hidden, vocab, warmup=1, **how))


def recommend_chunk(rows: list[dict[str, Any]], time_slack: float = 0.10) -> int:
    """The chunk size with the smallest peak memory among those within ``time_slack`` of the fastest.

    Small chunks save memory until the per-chunk GEMMs get too thin to run at full speed; this
    takes the memory win only while it costs at most ``time_slack`` (10%) in step time.
    """
    if not rows:
        raise ValueError("recommend_chunk needs at least one measured chunk size")
    fastest = min(r["time_ms"] for r in rows)
    fast_enough = [r for r in rows if r["time_ms"] <= fastest * (1 + time_slack)]
    return int(min(fast_enough, key=lambda r: (r["peak_mb"], r["time_ms"]))["chunk_size"])


# ---------------------------------------------------------------------------------------------
# A model training step, in this process


def train_step(model, optimizer, batch: dict[str, torch.Tensor]) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss.item()  # .item() waits for the device, so the step is complete when timed


def time_steps(model, batches: list[dict[str, torch.Tensor]], steps: int, warmup: int = 1, lr: float = 1e-4) -> list[float]:
    """Wall time (ms) of ``steps`` training steps after ``warmup`` untimed ones."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        train_step(model, opt, batches[i % len(batches)])
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def tokens_in(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["attention_mask"].sum())


def top_ops(model, batches: list[dict[str, torch.Tensor]], steps: int = 2, top: int = 15) -> list[dict[str, Any]]:
    """The ``top`` operators by self time over ``steps`` training steps (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, batches[0])  # warm-up outside the window
    with _native_stderr_silenced(), profile(activities=activities) as prof:
        for i in range(steps):
            train_step(model, opt, batches[i % len(batches)])
    on_device = device.type != "cpu"
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", 0.0) if on_device else 0.0
        rows.append(
            {
                "op": e.key,
                "calls": int(e.count),
                "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "cpu_total_ms": e.cpu_time_total / 1e3,
                "self_device_ms": device_us / 1e3,
            }
        )
    key = "self_device_ms" if on_device else "self_cpu_ms"
    rows.sort(key=lambda r: -r[key])
    total = sum(r[key] for r in rows) or 1.0
    for r in rows:
        r["share"] = r[key] / total
    return rows[:top]


@contextlib.contextmanager
def _native_stderr_silenced():
    """Kineto writes ``USDT: profiler_start/stop`` lines straight to file descriptor 2, which a
    notebook shows as red error output; those two lines are all it writes there on a clean run."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def fused_available(device: torch.device) -> tuple[bool, str]:
    """Whether fused kernels exist for ``device`` here, and what runs there (the patch route)."""
    route = dispatch.routes("auto").get(device.type, "original")
    return not route.startswith("original"), route


def fused_vs_unfused(model, batches: list[dict[str, torch.Tensor]], steps: int, warmup: int = 1) -> dict[str, Any]:
    """Step times with HF's ops and with qwenkit's fused ops on the same model (patched, then reverted)."""
    device = next(model.parameters()).device
    ok, route = fused_available(device)
    if not ok:
        return {"available": False, "route": route}
    unfused = time_steps(model, batches, steps, warmup)
    report = patches.apply(model, applicable=family.of_model(model).fused_ops)  # the ops the trainer patches
    try:
        fused = time_steps(model, batches, steps, warmup)
    finally:
        patches.revert(model)
    return {"available": True, "route": route, "active": report.active, "unfused_ms": unfused, "fused_ms": fused}


# What stays HF's: never fused, whatever the family
ORIGINAL = {"text_mrope": "original: HF's implementation, never fused"}
# the linear-attention layers' own ops (families with linear_attention in their mixers: Qwen3.5)
LINEAR_ATTENTION = {
    "linear attention: conv1d, gated delta rule": "original: HF's functions (causal-conv1d / flash-linear-attention "
    "where installed on CUDA, else HF's PyTorch fallback); packed rows per sample (qwenkit.model.families.linear_attention)",
    "linear attention: gated RMSNorm": "original: HF's Qwen3_5RMSNormGated",
}  # fmt: skip


def fused_ops_rows(model) -> list[dict[str, Any]]:
    """What the trainer's fused ops patch in ``model`` and what stays HF's, one row per op: the
    patch report the run log shows (its family's entry says which ops fit; patched and reverted
    here at once: a patched module picks its kernel per call, so the plan is the same on every
    device), then the ops that are never fused."""
    report = patches.apply(model, applicable=(entry := family.of_model(model)).fused_ops)
    patches.revert(model)
    rows = [{"op": o.op, "modules": o.matched,
             "status": o.status + "".join(f"; {k} {v}" for k, v in sorted(o.where.items()))} for o in report.ops]  # fmt: skip
    never = {**ORIGINAL, **(LINEAR_ATTENTION if "linear_attention" in entry.mixers else {})}
    return rows + [{"op": op, "modules": 0, "status": status} for op, status in never.items()]


def write_fused_ops(out_dir, rows: list[dict[str, Any]], device: str) -> None:
    """``fused_ops.csv``: :func:`fused_ops_rows`, the status as ``x``."""
    results.write_csv([results.record("modules", r["modules"], unit="1", series=r["op"], x_name="status", x=r["status"],
                                      device=device) for r in rows], f"{out_dir}/fused_ops.csv")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Summaries and result files


def utilisation(step_ms: list[float], flops: int, tokens: int, peak: dict[str, Any]) -> dict[str, Any]:
    """Median step time, achieved FLOP/s and MFU (model FLOPs / step time / measured matmul peak;
    :func:`qwenkit.bench.step.mfu`, None where it would exceed 1)."""
    median_s = statistics.median(step_ms) / 1e3
    achieved = flops / median_s
    return {
        "step_ms": 1e3 * median_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / median_s,
        "flops_per_step": flops,
        "achieved_flops_per_s": achieved,
        "matmul_peak_flops_per_s": peak["flops_per_s"],
        "mfu": mfu(flops, median_s, peak["flops_per_s"]),  # None above 1: the peak was measured too low
    }


def head_ratios(sweep: list[dict[str, Any]]) -> dict[str, float]:
    """Chunked over full time and peak memory at the longest sequence of a :func:`head_sweep`."""
    longest = max(r["seq_len"] for r in sweep)
    at = {r["head"]: r for r in sweep if r["seq_len"] == longest}
    return {
        "seq_len": longest,
        "time_ratio": at["chunked"]["time_ms"] / at["full"]["time_ms"],
        "peak_ratio": at["chunked"]["peak_mb"] / at["full"]["peak_mb"],
        "full_peak_mb": at["full"]["peak_mb"],
        "chunked_peak_mb": at["chunked"]["peak_mb"],
    }


HEAD_METRICS = (("time_ms", "ms"), ("time_min_ms", "ms"), ("time_max_ms", "ms"), ("peak_mb", "MiB"))
OP_COLUMNS = ("calls", "self_cpu_ms", "cpu_total_ms", "self_device_ms", "share")


def _head_rows(rows, series, x_name: str, device: str) -> list[dict[str, Any]]:
    return [results.record(metric, r[metric], unit=unit, series=series(r), x_name=x_name, x=r[x_name], device=device)
            for r in rows for metric, unit in HEAD_METRICS]  # fmt: skip


def _read_head_rows(path, x_name: str) -> list[dict[str, Any]]:
    out: dict[tuple, dict[str, Any]] = {}
    for r in results.read_csv(path):
        out.setdefault((r["series"], r["x"]), {"series": r["series"], x_name: r["x"]})[r["metric"]] = r["value"]
    return list(out.values())


def write_head_sweep(out_dir, sweep, device: str) -> None:
    """``loss_head.csv``: time (median, min, max) and peak memory per head and sequence length."""
    results.write_csv(_head_rows(sweep, lambda r: f"{r['head']} head", "seq_len", device), f"{out_dir}/loss_head.csv")


def write_chunk_sweep(out_dir, chunks, device: str) -> None:
    """``chunk_sweep.csv``: the chunked head at one sequence length over chunk sizes."""
    results.write_csv(_head_rows(chunks, lambda r: f"chunk sweep at {r['seq_len']}", "chunk_size", device),
                      f"{out_dir}/chunk_sweep.csv")  # fmt: skip


def write_model_step(out_dir, util: dict[str, Any], device: str) -> None:
    """``model_step.csv``: the training step's time, FLOPs and MFU."""
    results.write_csv([results.record(k, v, series="model step", device=device) for k, v in util.items() if v is not None],
                      f"{out_dir}/model_step.csv")  # fmt: skip


def write_top_ops(out_dir, ops: list[dict[str, Any]], device: str) -> None:
    """``top_ops.csv``: the profiler's top operators (series = operator, x = rank)."""
    results.write_csv(
        [results.record(col, r[col], series=r["op"], x_name="rank", x=i + 1, device=device)
         for i, r in enumerate(ops) for col in OP_COLUMNS],  # fmt: skip
        f"{out_dir}/top_ops.csv",
    )


def write_fused(out_dir, fused: dict[str, Any], device: str) -> None:
    """``fused_steps.csv``: step times with HF's and with the fused ops (empty without fused kernels)."""
    results.write_csv(
        [results.record("step_time", t, unit="ms", series=name.removesuffix("_ms"), x_name="step", x=i + 1, device=device)
         for name in ("unfused_ms", "fused_ms") for i, t in enumerate(fused.get(name, []))],  # fmt: skip
        f"{out_dir}/fused_steps.csv",
    )


def write_reference(out_dir) -> None:
    """``npu_reference.json``: the recorded NPU numbers, beside the run's own results."""
    Path(f"{out_dir}/npu_reference.json").write_text(json.dumps(NPU_REFERENCE, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------
# Figures, drawn from the result files alone


def head_sweep_figure(out_dir, title: str = "Loss head: full vs chunked"):
    rows = _read_head_rows(f"{out_dir}/loss_head.csv", "seq_len")
    return plots.head_sweep([{**r, "head": r["series"].removesuffix(" head")} for r in rows], title)


def chunk_sweep_figure(out_dir, title: str = "Chunk size: smallest memory within 10% of the fastest"):
    rows = _read_head_rows(f"{out_dir}/chunk_sweep.csv", "chunk_size")
    return plots.chunk_sweep(rows, recommend_chunk(rows), title)


def model_step_table(out_dir, title: str = "Training step"):
    util = {r["metric"]: r["value"] for r in results.read_csv(f"{out_dir}/model_step.csv")}
    return plots.table([util], list(util), title=title, formats=STEP_FORMATS)


def top_ops_table(out_dir, title: str = "Top operators by self time"):
    ops: dict[str, dict[str, Any]] = {}
    for r in results.read_csv(f"{out_dir}/top_ops.csv"):
        ops.setdefault(r["series"], {"op": r["series"]})[r["metric"]] = r["value"]
    rows = [{**o, "calls": int(o["calls"])} for o in ops.values()]
    return plots.table(rows, ["op", *OP_COLUMNS], title=title, formats=OP_FORMATS)


def fused_figure(out_dir, title: str = "Step time, unfused vs fused"):
    """The box plot of fused vs unfused step times; None when the device had no fused kernels."""
    rows = results.read_csv(f"{out_dir}/fused_steps.csv")
    if not rows:
        return None
    return plots.step_times({s: [r["value"] for r in rows if r["series"] == s] for s in ("unfused", "fused")}, title)


def fused_ops_table(out_dir, title: str = "Fused ops: what is patched, what stays HF's"):
    rows = [{"op": r["series"], "modules": int(r["value"]), "status": r["x"]}
            for r in results.read_csv(f"{out_dir}/fused_ops.csv")]  # fmt: skip
    return plots.table(rows, ["op", "modules", "status"], title=title)


def reference_figure(out_dir):
    ref = json.loads(Path(f"{out_dir}/npu_reference.json").read_text())
    return plots.npu_reference({**ref, "loss_range": tuple(ref["loss_range"])})


PACKING_FILE = "packing.jsonl"


def write_packing(out_dir, source) -> bool:
    """Copy ``benchmarks/packing.py --out`` rows into the notebook's folder; False when there are none."""
    source = Path(source)
    if not source.is_file():
        return False
    results.write_jsonl(results.read_jsonl(source), Path(out_dir) / PACKING_FILE)
    return True


def packing_figure(out_dir):
    """The packing benchmark's recorded rows (:func:`write_packing`), or None when none were copied."""
    path = Path(out_dir) / PACKING_FILE
    if not path.is_file():
        return None
    return plots.packing(results.read_jsonl(path), "Packing, RECORDED by benchmarks/packing.py (not measured here)")


def figures(out_dir) -> list:
    """Every figure of notebook 04, in the order it shows them."""
    figs = [head_sweep_figure(out_dir), chunk_sweep_figure(out_dir), model_step_table(out_dir), top_ops_table(out_dir),
            fused_ops_table(out_dir), fused_figure(out_dir), reference_figure(out_dir), packing_figure(out_dir)]  # fmt: skip
    return [f for f in figs if f is not None]


def _percent(mfu: float | None) -> str:
    return "error (above 1: the matmul peak was measured too low)" if mfu is None else f"{100 * mfu:.1f}%"


def save(out_dir, sweep, recommended: int, util: dict[str, Any], fused: dict[str, Any], device: str) -> dict[str, Any]:
    """``metrics.json`` (the CSVs are written as each part is measured: ``write_*``); returns its values."""
    ratios = head_ratios(sweep)
    values = {"head": ratios, "recommended_chunk": recommended, **util, "fused_available": fused["available"],
              "fused_route": fused["route"], "device": device}  # fmt: skip
    if Path(f"{out_dir}/fused_ops.csv").is_file():  # notebook 04's fused_ops_rows: op -> patched, or why not
        values["fused_ops"] = {r["series"]: r["x"] for r in results.read_csv(f"{out_dir}/fused_ops.csv")}
    if fused["available"]:
        values["fused_speedup"] = statistics.median(fused["unfused_ms"]) / statistics.median(fused["fused_ms"])
        fused_text = f"fused ops {values['fused_speedup']:.2f}x"
    else:
        fused_text = f"no fused kernels for {device} here ({fused['route']})"
    summary = (
        f"chunked head at {ratios['seq_len']} tokens: {ratios['peak_ratio']:.2f}x the full head's peak memory, "
        f"{ratios['time_ratio']:.2f}x its time; recommended chunk {recommended}; model step "
        f"{util['step_ms']:.0f} ms, MFU {_percent(util['mfu'])} of a measured "
        f"{util['matmul_peak_flops_per_s'] / 1e9:.0f} GFLOP/s matmul peak ({device}); {fused_text}"
    )
    passed = ratios["peak_ratio"] < 1.0 and util["mfu"] is not None and util["mfu"] > 0
    results.write_metrics(out_dir, "04_performance_profiling", summary, passed, **values)
    return values
