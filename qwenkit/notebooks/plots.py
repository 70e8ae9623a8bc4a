"""Plotly figures for the notebooks, built from result rows (long-format dicts or plain records).

Every function returns a ``plotly.graph_objects.Figure`` and draws nothing itself; the notebook
displays it (through :mod:`qwenkit.notebooks.renderer`, which also puts it in the HTML report).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
REFERENCE_COLOUR = "#7f7f7f"  # recorded reference points: grey, never a run's colour


def _finish(fig: go.Figure, title: str, height: int = 420) -> go.Figure:
    fig.update_layout(title=title, height=height, margin=dict(l=60, r=20, t=70, b=50), legend_title_text="")
    return fig


def _log_x(fig: go.Figure, values: Iterable[float], title: str, **where: int) -> None:
    """A log x axis ticked at the measured values (plotly's default log ticks read 2, 5, 1000, 2, ...)."""
    ticks = sorted(set(values))
    fig.update_xaxes(title_text=title, type="log", tickvals=ticks, ticktext=[f"{v:g}" for v in ticks], **where)


def _groups(rows: Iterable[dict[str, Any]], key: str) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


# ---------------------------------------------------------------------------------------------
# Generic


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str = "", formats: dict[str, str] | None = None) -> go.Figure:
    """A table of ``rows``; ``formats`` maps a column to a format spec such as ``".2e"``."""
    formats = formats or {}

    def cell(value: Any, col: str) -> str:
        if isinstance(value, bool):
            return "yes" if value else "NO"
        if isinstance(value, float) and col in formats:
            return format(value, formats[col])
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    values = [[cell(r.get(c, ""), c) for r in rows] for c in columns]
    fig = go.Figure(go.Table(header=dict(values=list(columns), align="left"), cells=dict(values=values, align="left")))
    return _finish(fig, title, height=min(140 + 30 * (len(rows) + 1), 900))


def histogram(values: Sequence[float], title: str, x_title: str, limit: float | None = None, limit_name: str = "") -> go.Figure:
    """Distribution of ``values``; ``limit`` draws a dashed vertical line (e.g. data.max_length)."""
    fig = go.Figure(go.Histogram(x=list(values), marker_color=COLOURS[0], name="samples"))
    if limit is not None:
        fig.add_vline(x=limit, line_dash="dash", line_color=COLOURS[1], annotation_text=limit_name or str(limit))
    fig.update_xaxes(title=x_title)
    fig.update_yaxes(title="samples")
    return _finish(fig, title, height=360)


# ---------------------------------------------------------------------------------------------
# 02: training metrics (long-format rows: metric, series, x = step, value)

TRAIN_PANELS = (
    ("loss", "loss", "nat"),
    ("grad_norm", "grad norm", ""),
    ("lr", "learning rate", ""),
    ("step_time", "step time", "s"),
    ("tokens_per_s", "tokens/s", ""),
    ("peak_memory", "peak memory", "MiB"),
)


def training_metrics(rows: Sequence[dict[str, Any]], title: str = "Training metrics per rank") -> go.Figure:
    """A 3 x 2 grid, one panel per metric, one line per series (rank)."""
    panels = [p for p in TRAIN_PANELS if any(r["metric"] == p[0] for r in rows)]
    ncols = 2
    nrows = max(1, -(-len(panels) // ncols))
    fig = make_subplots(rows=nrows, cols=ncols, subplot_titles=[p[1] for p in panels], vertical_spacing=0.12)
    series_names = sorted({r["series"] for r in rows})
    for i, (metric, _, unit) in enumerate(panels):
        row, col = i // ncols + 1, i % ncols + 1
        for k, name in enumerate(series_names):
            # a step logged twice (a resumed run appends) keeps its last value
            pts = sorted({r["x"]: r["value"] for r in rows if r["metric"] == metric and r["series"] == name}.items())
            if not pts:
                continue
            fig.add_trace(
                go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name,
                           legendgroup=name, showlegend=i == 0, line_color=COLOURS[k % len(COLOURS)]),
                row=row, col=col,
            )  # fmt: skip
        fig.update_xaxes(title_text="step", row=row, col=col)
        if unit:
            fig.update_yaxes(title_text=unit, row=row, col=col)
    return _finish(fig, title, height=300 * nrows)


def live_progress(steps: Sequence[int], loss: Sequence[float], tokens_per_s: Sequence[float], title: str) -> go.Figure:
    """A training run's loss and tokens/s by step, so far (the live view while it trains)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["loss", "tokens/s (rank 0)"], horizontal_spacing=0.1)
    fig.add_trace(go.Scatter(x=list(steps), y=list(loss), mode="lines", line_color=COLOURS[0], showlegend=False), 1, 1)
    fig.add_trace(go.Scatter(x=list(steps), y=list(tokens_per_s), mode="lines", line_color=COLOURS[2], showlegend=False), 1, 2)
    fig.update_xaxes(title_text="step")
    return _finish(fig, title, height=320)


def resume_overlay(
    uninterrupted: dict[int, float], resumed: dict[int, float], resume_step: int, metric: str = "loss"
) -> go.Figure:
    """The resumed run's curve over the uninterrupted one, with their difference; the x axis
    starts before the resume step by as many steps as were resumed (the whole curve is in the
    metrics figure)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.7, 0.3], vertical_spacing=0.08,
                        subplot_titles=[metric, "resumed - uninterrupted"])  # fmt: skip
    steps = sorted(uninterrupted)
    fig.add_trace(go.Scatter(x=steps, y=[uninterrupted[s] for s in steps], name="uninterrupted",
                             mode="lines+markers", line=dict(color=COLOURS[0], width=4)), row=1, col=1)  # fmt: skip
    rsteps = sorted(resumed)
    fig.add_trace(go.Scatter(x=rsteps, y=[resumed[s] for s in rsteps], name="resumed",
                             mode="lines+markers", line=dict(color=COLOURS[3], dash="dash")), row=1, col=1)  # fmt: skip
    both = [s for s in rsteps if s in uninterrupted]
    fig.add_trace(go.Bar(x=both, y=[resumed[s] - uninterrupted[s] for s in both], name="difference",
                         marker_color=COLOURS[3], showlegend=False), row=2, col=1)  # fmt: skip
    fig.add_vline(x=resume_step + 0.5, line_dash="dot", line_color=REFERENCE_COLOUR,
                  annotation_text=f"resumed from step {resume_step}")  # fmt: skip
    fig.update_xaxes(title_text="step", row=2, col=1)
    last = max(steps + rsteps, default=resume_step)
    fig.update_xaxes(range=[max(0, 2 * resume_step - last) + 0.5, last + 0.5])
    return _finish(fig, f"Resumed from step {resume_step} vs uninterrupted: {metric}", height=520)


def eval_over_training(train_loss: dict[int, float], eval_loss: dict[int, float]) -> go.Figure:
    """Held-out loss (its own markers, at the evaluation steps) drawn over the training-loss curve."""
    fig = go.Figure()
    steps = sorted(train_loss)
    fig.add_trace(go.Scatter(x=steps, y=[train_loss[s] for s in steps], name="training loss", mode="lines",
                             line_color=COLOURS[0]))  # fmt: skip
    esteps = sorted(eval_loss)
    fig.add_trace(go.Scatter(x=esteps, y=[eval_loss[s] for s in esteps], name="eval loss (held-out)",
                             mode="lines+markers", line=dict(color=COLOURS[1], dash="dash"), marker_size=9))  # fmt: skip
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="loss (token mean)")
    return _finish(fig, "Training loss and held-out eval loss")


def accuracy_before_after(accuracy: dict[int, float]) -> go.Figure:
    """Exact-match accuracy on the held-out rows at each step it was measured (step 0 = untrained)."""
    steps = sorted(accuracy)
    labels = [f"step {s}" + (" (untrained)" if s == 0 else "") for s in steps]
    fig = go.Figure(go.Bar(x=labels, y=[accuracy[s] for s in steps], text=[f"{accuracy[s]:.2f}" for s in steps],
                           textposition="outside", marker_color=[COLOURS[3] if s == 0 else COLOURS[2] for s in steps]))  # fmt: skip
    fig.update_yaxes(title_text="eval accuracy (exact match)", range=[0, 1.1])
    return _finish(fig, "Held-out accuracy: untrained, during and after training", height=360)


def preference_over_training(accuracy: dict[str, dict[int, float]], margins: dict[str, dict[int, float]],
                             start: float | None) -> go.Figure:  # fmt: skip
    """A DPO run's held-out preference accuracy (left) and reward margins (right) over its steps.

    ``accuracy`` / ``margins``: ``{curve name: {step: value}}``; ``start``: the SFT start's own
    preference accuracy (the DPO run's step 0), drawn as a grey line across the left panel.
    """
    fig = make_subplots(rows=1, cols=2, subplot_titles=["held-out preference accuracy", "reward margin (nats x beta)"])
    for col, curves in ((1, accuracy), (2, margins)):
        for k, (name, values) in enumerate(curves.items()):
            steps = sorted(values)
            fig.add_trace(go.Scatter(x=steps, y=[values[s] for s in steps], name=name,
                                     mode="lines+markers" if len(steps) < 30 else "lines",
                                     line_color=COLOURS[(k + 2 * (col - 1)) % len(COLOURS)]), row=1, col=col)  # fmt: skip
    if start is not None and accuracy:
        steps = sorted({s for values in accuracy.values() for s in values})
        fig.add_trace(go.Scatter(x=[steps[0], steps[-1]], y=[start, start], name="the SFT start", mode="lines",
                                 line=dict(color=REFERENCE_COLOUR, dash="dash")), row=1, col=1)  # fmt: skip
    fig.update_xaxes(title_text="DPO step")
    fig.update_yaxes(range=[0, 1.05], row=1, col=1)
    return _finish(fig, "DPO from the SFT run: held-out preference accuracy and reward margins", height=420)


# ---------------------------------------------------------------------------------------------
# 03: chunk vs full


def loss_curves(rows: Sequence[dict[str, Any]], title: str = "AdamW training: full vs chunked loss head") -> go.Figure:
    """Both runs' losses overlaid, and ``chunk - full`` per step below."""
    by_mode = {m: {r["step"]: r["loss"] for r in rs} for m, rs in _groups(rows, "mode").items()}
    full, chunk = by_mode["full"], by_mode["chunk"]
    steps = sorted(full)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35], vertical_spacing=0.08,
                        subplot_titles=["loss", "chunked - full"])  # fmt: skip
    fig.add_trace(go.Scatter(x=steps, y=[full[s] for s in steps], name="full logits (HF)", mode="lines",
                             line=dict(color=COLOURS[0], width=5)), row=1, col=1)  # fmt: skip
    fig.add_trace(go.Scatter(x=steps, y=[chunk[s] for s in steps], name="chunked", mode="lines+markers",
                             line=dict(color=COLOURS[1], dash="dash")), row=1, col=1)  # fmt: skip
    fig.add_trace(go.Scatter(x=steps, y=[chunk[s] - full[s] for s in steps], name="difference", mode="lines+markers",
                             line_color=COLOURS[1], showlegend=False), row=2, col=1)  # fmt: skip
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_yaxes(exponentformat="e", row=2, col=1)
    return _finish(fig, title, height=520)


def _with_case(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**r, "case": f"{r['modality']} / {r['loss_type']}"} for r in rows]


def grad_diff_by_chunk(cases: Sequence[dict[str, Any]]) -> go.Figure:
    """Largest gradient and loss difference vs chunk size, one line per modality/loss type.

    No tolerance line: the check is element-wise, ``atol + rtol * |reference|``, so a difference
    above ``atol`` alone can pass (see the table's ``passed`` column).
    """
    fig = make_subplots(rows=1, cols=2, subplot_titles=["max |grad diff| (all parameters)", "|loss diff|"])
    for k, (name, rs) in enumerate(_groups(_with_case(cases), "case").items()):
        rs = sorted(rs, key=lambda r: r["chunk_size"])
        x = [r["chunk_size"] for r in rs]
        colour = COLOURS[k % len(COLOURS)]
        fig.add_trace(go.Scatter(x=x, y=[r["grad_max_abs_diff"] for r in rs], name=name, legendgroup=name,
                                 mode="lines+markers", line_color=colour), row=1, col=1)  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=[r["loss_abs_diff"] for r in rs], name=name, legendgroup=name,
                                 showlegend=False, mode="lines+markers", line_color=colour), row=1, col=2)  # fmt: skip
    for col in (1, 2):
        _log_x(fig, [c["chunk_size"] for c in cases], "chunk size (tokens)", row=1, col=col)
    fig.update_yaxes(title_text="absolute difference", exponentformat="e", row=1, col=1)
    fig.update_yaxes(exponentformat="e", row=1, col=2)
    return _finish(fig, "Chunked vs full head: differences by chunk size", height=420)


def grad_diff_per_param(per_param: Sequence[dict[str, Any]], chunk_size: int) -> go.Figure:
    """Max |grad diff| of each parameter at one chunk size (the chunk-size slider's view)."""
    rows = [r for r in per_param if r["chunk_size"] == chunk_size]
    fig = go.Figure()
    for k, (name, rs) in enumerate(_groups(_with_case(rows), "case").items()):
        fig.add_trace(go.Bar(x=[r["param"] for r in rs], y=[r["max_abs_diff"] for r in rs], name=name,
                             marker_color=COLOURS[k % len(COLOURS)]))  # fmt: skip
    fig.update_xaxes(showticklabels=False, title="parameter tensors (hover for names)")
    fig.update_yaxes(title="max |grad diff|", exponentformat="e")
    fig.update_layout(barmode="group")
    return _finish(fig, f"Per-parameter gradient difference at chunk size {chunk_size}", height=380)


# ---------------------------------------------------------------------------------------------
# 04: performance


def _spread(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Error bars from each point's median down to its fastest and up to its slowest pass, when measured."""
    if not all("time_min_ms" in r and "time_max_ms" in r for r in rows):
        return None
    return dict(type="data", symmetric=False, array=[r["time_max_ms"] - r["time_ms"] for r in rows],
                arrayminus=[r["time_ms"] - r["time_min_ms"] for r in rows])  # fmt: skip


def head_sweep(rows: Sequence[dict[str, Any]], title: str) -> go.Figure:
    """Step time (median, bars from fastest to slowest pass) and peak memory vs sequence length, one line per head."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=["forward + backward time (ms): median, min-max", "peak memory (MiB)"])
    for k, (name, rs) in enumerate(_groups(rows, "head").items()):
        rs = sorted(rs, key=lambda r: r["seq_len"])
        x = [r["seq_len"] for r in rs]
        colour = COLOURS[k % len(COLOURS)]
        fig.add_trace(go.Scatter(x=x, y=[r["time_ms"] for r in rs], name=name, legendgroup=name, error_y=_spread(rs),
                                 mode="lines+markers", line_color=colour), row=1, col=1)  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=[r["peak_mb"] for r in rs], name=name, legendgroup=name, showlegend=False,
                                 mode="lines+markers", line_color=colour), row=1, col=2)  # fmt: skip
    for col in (1, 2):
        _log_x(fig, [r["seq_len"] for r in rows], "sequence length (tokens)", row=1, col=col)
    return _finish(fig, title)


def chunk_sweep(rows: Sequence[dict[str, Any]], recommended: int, title: str) -> go.Figure:
    """Time and peak memory vs chunk size; the recommended size is marked."""
    rows = sorted(rows, key=lambda r: r["chunk_size"])
    x = [r["chunk_size"] for r in rows]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=x, y=[r["time_ms"] for r in rows], name="time (ms)", mode="lines+markers",
                             error_y=_spread(rows), line_color=COLOURS[0]), secondary_y=False)  # fmt: skip
    fig.add_trace(go.Scatter(x=x, y=[r["peak_mb"] for r in rows], name="peak memory (MiB)", mode="lines+markers",
                             line_color=COLOURS[3]), secondary_y=True)  # fmt: skip
    best = next(r for r in rows if r["chunk_size"] == recommended)
    fig.add_trace(go.Scatter(x=[recommended], y=[best["peak_mb"]], name=f"recommended: {recommended}", mode="markers",
                             marker=dict(symbol="star", size=18, color=COLOURS[2])), secondary_y=True)  # fmt: skip
    _log_x(fig, x, "chunk size (tokens)")
    fig.update_yaxes(title_text="time (ms)", secondary_y=False)
    fig.update_yaxes(title_text="peak memory (MiB)", secondary_y=True)
    return _finish(fig, title)


def step_times(series: dict[str, Sequence[float]], title: str) -> go.Figure:
    """Box plot of per-step times (ms) for each named variant (e.g. unfused / fused)."""
    fig = go.Figure()
    for k, (name, times) in enumerate(series.items()):
        fig.add_trace(go.Box(y=list(times), name=name, marker_color=COLOURS[k % len(COLOURS)], boxpoints="all"))
    fig.update_yaxes(title="step time (ms)")
    return _finish(fig, title, height=380)


def npu_reference(ref: dict[str, Any]) -> go.Figure:
    """The original integration's NPU numbers, drawn in grey and titled as recorded, not measured."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.55, 0.45],
                        subplot_titles=["steady step time (ms)", f"loss band over {ref['steps']} steps"])  # fmt: skip
    names = list(ref["step_ms"])
    values = [ref["step_ms"][n] for n in names]
    fig.add_trace(go.Bar(x=names, y=values, text=[f"{v:.1f} ms" for v in values], textposition="outside",
                         marker_color=REFERENCE_COLOUR, marker_pattern_shape="/", name="recorded step time"),
                  row=1, col=1)  # fmt: skip
    lo, hi = ref["loss_range"]
    fig.add_trace(go.Scatter(x=[1, ref["steps"], ref["steps"], 1, 1], y=[lo, lo, hi, hi, lo], fill="toself",
                             mode="lines", line_color=REFERENCE_COLOUR, name=f"recorded loss range {lo}-{hi}"),
                  row=1, col=2)  # fmt: skip
    fig.update_yaxes(range=[0, max(values) * 1.2], row=1, col=1)
    fig.update_xaxes(title_text="step", row=1, col=2)
    speedup = ref["step_ms"]["unfused"] / ref["step_ms"]["fused"]
    title = (f"RECORDED REFERENCE, not this run: {ref['hardware']}, {ref['model']}, {ref['steps']} steps "
             f"(fused ops {speedup:.2f}x)")  # fmt: skip
    return _finish(fig, title, height=400)


def packing(rows: Sequence[dict[str, Any]], title: str) -> go.Figure:
    """``benchmarks/packing.py --out`` rows: effective tokens/s, peak memory and padding per variant.

    Bars are labelled with their ratio to the first variant (padded), as the benchmark prints them.
    """
    fig = make_subplots(rows=1, cols=3, subplot_titles=["effective (non-pad) tokens/s", "peak memory (GiB)",
                                                        "padding fraction"])  # fmt: skip
    names = [r["variant"] for r in rows]
    base = rows[0]
    panels = (
        ([r["effective_tokens_per_s"] for r in rows], [f"{r['speedup']:.2f}x" for r in rows]),
        ([r["peak_bytes"] / 2**30 for r in rows], [f"{r['peak_bytes'] / base['peak_bytes']:.2f}x" for r in rows]),
        ([r["padding_fraction"] for r in rows], [f"{r['padding_fraction']:.1%}" for r in rows]),
    )
    for col, (values, text) in enumerate(panels, start=1):
        fig.add_trace(go.Bar(x=names, y=values, text=text, textposition="outside", showlegend=False,
                             marker_color=[COLOURS[k % len(COLOURS)] for k in range(len(rows))]), row=1, col=col)  # fmt: skip
        fig.update_yaxes(range=[0, max(max(values), 1e-9) * 1.25], row=1, col=col)
    return _finish(fig, title, height=400)


# ---------------------------------------------------------------------------------------------
# 05: runs side by side


def run_curves(curves: dict[str, Sequence[tuple[float, float]]], styles: dict[str, dict[str, str]], y_title: str,
               title: str, y_range: Sequence[float] | None = None) -> go.Figure:  # fmt: skip
    """One line per run (``{name: [(step, value), ...]}``), each in its ``styles[name]`` colour and dash."""
    fig = go.Figure()
    for name, pts in curves.items():
        if pts:
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], name=name,
                                     mode="lines+markers" if len(pts) < 30 else "lines",
                                     line=dict(color=styles[name]["colour"], dash=styles[name]["dash"])))  # fmt: skip
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text=y_title)
    if y_range is not None:
        fig.update_yaxes(range=list(y_range))
    return _finish(fig, title)


def metric_effect(groups: dict[str, dict[str, list[float]]], y_title: str, title: str) -> go.Figure:
    """One panel per key (``{key: {value label: [metric of each run]}}``): a marker per run, the
    mean per value as a line with its min-max as the error bar (seeds and the other keys' values)."""
    keys = list(groups) or ["(nothing varied)"]
    fig = make_subplots(rows=1, cols=len(keys), subplot_titles=keys, shared_yaxes=True)
    for i, key in enumerate(groups, 1):
        labels = list(groups[key])
        points = [(label, v) for label in labels for v in groups[key][label]]
        fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="markers", name="runs",
                                 marker=dict(color=REFERENCE_COLOUR, size=8), showlegend=i == 1), row=1, col=i)  # fmt: skip
        means = [sum(groups[key][lb]) / len(groups[key][lb]) for lb in labels]
        fig.add_trace(go.Scatter(
            x=labels, y=means, mode="lines+markers", name="mean (min-max)", showlegend=i == 1,
            line_color=COLOURS[0], marker_size=11,
            error_y=dict(type="data", symmetric=False, array=[max(groups[key][lb]) - m for lb, m in zip(labels, means)],
                         arrayminus=[m - min(groups[key][lb]) for lb, m in zip(labels, means)]),
        ), row=1, col=i)  # fmt: skip
        fig.update_xaxes(type="category", title_text=key, row=1, col=i)
    fig.update_yaxes(title_text=y_title, row=1, col=1)
    return _finish(fig, title, height=400)


def heatmap(z: Sequence[Sequence[float]], x_title: str, y_title: str, scale_title: str, title: str) -> go.Figure:
    """``z[row][column]`` as colours (rows bottom-up), e.g. a MoE run's share of tokens per layer and expert."""
    fig = go.Figure(go.Heatmap(z=z, colorscale="Viridis", colorbar=dict(title=scale_title)))
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=y_title)
    return _finish(fig, title)
