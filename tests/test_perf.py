"""Notebook 04's measurements: chunk recommendation, a loss-head case in a fresh process, a model step."""

import pytest
import torch

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit import model as qmodel
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
    # full logits [512, 8192] fp32 = 16 MiB, held more than once; the chunk is 2 MiB
    assert full["peak_mb"] > chunked["peak_mb"] + 8


def test_matmul_peak_and_model_step_measurements(tiny_path, processor):
    cpu = torch.device("cpu")
    peak = perf.matmul_peak(cpu, torch.float32, size=256, repeats=2)
    assert peak["flops_per_s"] > 0
    cfg = qconfig.load()
    model = qmodel.build(cfg.model, cfg.loss)
    batches = data.sample_batches(cfg, processor, 1, 2)
    flops = perf.step_flops(model, batches[0])
    params = sum(p.numel() for p in model.parameters())
    assert flops >= 2 * params * perf.tokens_in(batches[0])  # at least the forward's weight matmuls
    assert len(perf.time_steps(model, batches, steps=2)) == 2
    ops = perf.top_ops(model, batches, steps=1, top=5)
    assert len(ops) == 5 and ops[0]["self_cpu_ms"] >= ops[-1]["self_cpu_ms"]
    assert perf.fused_available(cpu)[0] is False
    assert perf.fused_vs_unfused(model, batches, steps=1)["available"] is False
