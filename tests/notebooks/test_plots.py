"""Figure builders: each draws what its rows hold; the report renderer carries no plotly.js and no CDN."""



from qwenkit.notebooks import perf, plots


def _train_rows():
    rows = []
    for rank in (0, 1):
        for step in (1, 2, 3):
            for metric in ("loss", "grad_norm", "lr", "step_time", "tokens_per_s", "peak_memory"):
                rows.append({"metric": metric, "series": f"rank {rank}", "x": step, "value": 10.0 - step, "rank": rank})
    rows.append({"metric": "loss", "series": "rank 0", "x": 3, "value": 99.0, "rank": 0})  # re-logged after a resume
    return rows


def test_training_metrics_one_panel_per_metric_one_line_per_rank():
    fig = plots.training_metrics(_train_rows())
    assert len(fig.data) == 6 * 2
    loss_rank0 = next(t for t in fig.data if t.name == "rank 0")
    assert list(loss_rank0.x) == [1, 2, 3] and loss_rank0.y[-1] == 99.0  # the last row of a step wins
    assert sum(t.showlegend is not False for t in fig.data) == 2


def test_resume_overlay_draws_both_curves_and_their_difference():
    a = {1: 3.0, 2: 2.0, 3: 1.0}
    b = {1: 3.0, 2: 2.0, 3: 1.5}
    fig = plots.resume_overlay(a, b, resume_step=2)
    names = [t.name for t in fig.data]
    assert names == ["uninterrupted", "resumed", "difference"]
    assert list(fig.data[2].y) == [0.0, 0.0, 0.5]
    long = {s: 1.0 / s for s in range(1, 301)}
    fig = plots.resume_overlay(long, {s: long[s] for s in range(281, 301)}, resume_step=280)
    assert tuple(fig.layout.xaxis.range) == (260.5, 300.5)  # the resumed steps and as many before them


def _curve_rows():
    return [{"step": s, "mode": m, "loss": 5.0 - s + (1e-7 if m == "chunk" else 0)} for m in ("full", "chunk")
            for s in (1, 2, 3)]  # fmt: skip


def test_loss_curves_and_chunk_figures():
    fig = plots.loss_curves(_curve_rows())
    assert len(fig.data) == 3 and max(abs(v) for v in fig.data[2].y) < 1e-6
    cases = [{"modality": mo, "loss_type": "token_mean", "chunk_size": c, "grad_max_abs_diff": 1e-8,
              "loss_abs_diff": 0.0} for mo in ("text", "image-text") for c in (7, 64)]
    fig = plots.grad_diff_by_chunk(cases)
    assert len(fig.data) == 4 and fig.layout.xaxis.type == "log" and list(fig.layout.xaxis.tickvals) == [7, 64]
    per_param = [{**c, "param": p, "max_abs_diff": 1e-8} for c in cases for p in ("a", "b")]
    fig = plots.grad_diff_per_param(per_param, 7)
    assert len(fig.data) == 2 and list(fig.data[0].x) == ["a", "b"]


def test_perf_figures_and_the_npu_reference_is_labelled_as_recorded():
    sweep = [{"head": h, "seq_len": s, "time_ms": 1.0, "peak_mb": 2.0} for h in ("full", "chunked") for s in (128, 256)]
    assert len(plots.head_sweep(sweep, "t").data) == 4
    chunks = [{"chunk_size": c, "time_ms": 1.0, "peak_mb": c / 10} for c in (32, 64)]
    fig = plots.chunk_sweep(chunks, 32, "t")
    assert len(fig.data) == 3 and fig.data[2].name == "recommended: 32" and list(fig.layout.xaxis.tickvals) == [32, 64]
    fig = plots.npu_reference(perf.NPU_REFERENCE)
    assert fig.layout.title.text.startswith("RECORDED REFERENCE, not this run")
    assert list(fig.data[0].y) == [670.6, 629.1]
    assert all(t.marker.color == plots.REFERENCE_COLOUR or t.line.color == plots.REFERENCE_COLOUR for t in fig.data)


def test_packing_benchmark_figure():
    rows = [
        {"variant": v, "effective_tokens_per_s": tps, "speedup": tps / 100, "peak_bytes": mem * 2**30,
         "padding_fraction": pad}
        for v, tps, mem, pad in (("padded", 100, 4.0, 0.4), ("packed", 150, 3.5, 0.0), ("budget", 160, 3.0, 0.0))
    ]  # fmt: skip
    fig = plots.packing(rows, "t")
    assert len(fig.data) == 3 and list(fig.data[0].x) == ["padded", "packed", "budget"]
    assert list(fig.data[0].text) == ["1.00x", "1.50x", "1.60x"] and list(fig.data[1].text)[2] == "0.75x"
    assert list(fig.data[2].y) == [0.4, 0.0, 0.0]


def test_table_formats_and_flags_failures():
    fig = plots.table([{"a": 1.23456e-7, "ok": True}, {"a": 2.0, "ok": False}], ["a", "ok"], formats={"a": ".1e"})
    cells = fig.data[0].cells.values
    assert list(cells[0]) == ["1.2e-07", "2.0e+00"] and list(cells[1]) == ["yes", "NO"]
