"""Notebook 04's measurements: chunk recommendation, a loss-head case in a fresh process, a model step."""

import pytest
import torch

from qwenkit import config as qconfig
from qwenkit.bench import step
from qwenkit.bench.measure import MAX_ROUNDS, head_case, head_measure
from qwenkit.model.families import build as registry
from qwenkit.notebooks import perf


def test_recommend_chunk_takes_memory_only_while_time_allows():
    rows = [
        {"chunk_size": 64, "time_ms": 150.0, "peak_mb": 10.0},  # smallest, but 50% slower
        {"chunk_size": 128, "time_ms": 105.0, "peak_mb": 20.0},  # within 10%: the pick
        {"chunk_size": 512, "time_ms": 100.0, "peak_mb": 60.0},  # fastest
    ]
    assert perf.recommend_chunk(rows) == 128
    assert perf.recommend_chunk(rows, time_slack=1.0) == 64
    assert perf.recommend_chunk(rows, time_slack=0.0) == 512
    with pytest.raises(ValueError):
        perf.recommend_chunk([])


def test_head_cases_in_fresh_processes_show_the_chunk_saving():
    rows = perf.head_sweep([512], chunk_size=64, hidden=64, vocab=8192, repeats=1)
    full, chunked = rows
    assert (full["head"], chunked["head"], chunked["chunk_size"]) == ("full", "chunked", 64)
    assert full["time_ms"] > 0 and chunked["time_ms"] > 0
    assert full["passes"] == chunked["passes"] == 1  # no minimum time: exactly the repeats asked for
    # full logits [512, 8192] fp32 = 16 MiB, held more than once; the chunk is 2 MiB
    assert full["peak_mb"] > chunked["peak_mb"] + 8


@pytest.mark.long
def test_heads_sharing_a_process_have_the_peaks_they_have_alone():
    """Reference: each head alone in its warmed-up process. Run in either order in one process,
    each head's peak is its own: the warm-up round takes the math libraries' one-time buffers
    out of the first head's peak, and the previous head's buffers are gone before the next."""
    shape = dict(seq_len=1024, hidden=256, vocab=8192, repeats=1, warmup=1)
    alone = {v: head_measure(head_case(v, **shape))[0]["peak_mb"] for v in ("full", "256")}
    # What a shared process could wrongly add is the other head's buffers: at least one [256, 8192]
    # fp32 chunk, 8 MiB. The peak is the process's RSS high-water mark, which also moves with
    # glibc's heap (freed blocks kept below its trim threshold), page granularity and OpenMP
    # thread stacks: 1-2 MiB between runs under load. The bound is half the smallest leftover.
    leftover_mb = 256 * shape["vocab"] * 4 / 2**20
    for order in (["full", "256"], ["256", "full"]):
        for row in head_measure(head_case(order, **shape)):
            assert row["peak_mb"] == pytest.approx(alone[row["variant"]], rel=0.03, abs=leftover_mb / 2), (order, row)
    with pytest.raises(ValueError, match="warm-up round"):
        head_case(["full", "256"], **{**shape, "warmup": 0})


def test_cheap_cases_repeat_until_their_minimum_time():
    rows = head_measure(head_case(["full", "64"], 128, 32, 1024, repeats=3, warmup=1, min_time_s=60.0))
    assert [r["passes"] for r in rows] == [MAX_ROUNDS] * 2  # sub-ms passes: more rounds, capped, alike per head
    assert all(r["time_min_ms"] <= r["time_ms"] <= r["time_max_ms"] for r in rows)


def test_matmul_peak_and_model_step_measurements(tiny_path, processor):
    cpu = torch.device("cpu")
    peak = perf.matmul_peak(cpu, torch.float32, size=256, repeats=2)
    assert peak["flops_per_s"] > 0
    assert peak["passes"] > 2  # a sub-ms GEMM repeats for min_time_s, not just twice (one busy moment was its peak)
    assert perf.matmul_peak(cpu, torch.float32, size=64, repeats=3, min_time_s=0)["passes"] == 3
    cfg = qconfig.load()
    model = registry.build(cfg.model, cfg.loss)
    batches = step.sample_batches(cfg, processor, 1, 2)
    flops = step.step_flops(model, batches[0])
    params = sum(p.numel() for p in model.parameters())
    assert flops >= 2 * params * perf.tokens_in(batches[0])  # at least the forward's weight matmuls
    assert len(perf.time_steps(model, batches, steps=2)) == 2
    ops = perf.top_ops(model, batches, steps=1, top=5)
    assert len(ops) == 5 and ops[0]["self_cpu_ms"] >= ops[-1]["self_cpu_ms"]
    assert perf.fused_available(cpu)[0] is False
    assert perf.fused_vs_unfused(model, batches, steps=1)["available"] is False


def test_use_cpu_threads_sets_this_process_threads_on_cpu_only():
    before = torch.get_num_threads()
    try:
        assert perf.use_cpu_threads(torch.device("cpu"), 1) == 1 == torch.get_num_threads()
        assert perf.use_cpu_threads(torch.device("meta"), 3) == 1  # not a CPU measurement: left alone
        assert perf.use_cpu_threads(torch.device("cpu"), 0) == 1  # 0: whatever torch has
    finally:
        torch.set_num_threads(before)


def test_memory_is_read_one_way_and_sees_a_cpu_peak():
    """device.memory_bytes: on CPU the peak (VmHWM) after a reset covers a tensor freed since. The tensor is
    on fresh anonymous pages (an mmap): glibc may hand out free memory still resident from earlier tests in
    this worker, which would not raise the peak (it did, after the whole suite's files on one worker)."""
    import mmap

    from qwenkit.device import memory_bytes, reset_peak_memory

    reset_peak_memory("cpu")
    base = memory_bytes("cpu", peak=False)
    size = 64 * 2**20
    pages = mmap.mmap(-1, size)
    x = torch.frombuffer(pages, dtype=torch.uint8)
    x.fill_(1)  # 64 MiB, written: resident
    del x
    pages.close()
    assert memory_bytes("cpu", peak=True) - base >= 0.9 * size
    assert memory_bytes("cpu", peak=True) >= memory_bytes("cpu", peak=False)
def _train_step_benchmark():
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))  # the script imports its sibling synthetic.py
    try:
        spec = importlib.util.spec_from_file_location("train_step_benchmark", bench / "train_step.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    return module


def test_train_step_benchmark_never_reports_an_mfu_above_one():
    ts = _train_step_benchmark()
    assert ts.mfu(0.5e9, 1.0, 1e9) == 0.5
    assert ts.mfu(1.17e9, 1.0, 1e9) is None  # a peak measured in a busy moment: an error, not a result
    assert ts._mfu_cell(None, 9) == "    error" and ts._mfu_cell(0.25, 9) == "     0.25"


@pytest.mark.slow
@pytest.mark.long
def test_train_step_benchmark_measures_the_peak_in_each_worker(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from multiproc import scaled

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, "benchmarks/train_step.py", "--shapes", "tiny", "--steps", "1", "--warmup", "0",
         "--gemm-size", "128", "--variants", "hf", "chunk", "--out", str(out)],
        cwd=root, capture_output=True, text=True, timeout=scaled(600),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for r in rows:  # each worker's own peak, the better of before and after its steps
        assert r["gemm_flops_per_s"] == max(r["gemm_before"], r["gemm_after"]) > 0
        assert r["mfu"] is None or 0 < r["mfu"] <= 1
    assert "GEMM GF/s" in proc.stdout
