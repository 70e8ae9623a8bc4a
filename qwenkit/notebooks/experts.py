"""Notebook 02's MoE figures: how evenly a run's routers spread the tokens over the experts.

From the run's files alone (:mod:`qwenkit.engine.run.expert_load`): the per-step metrics
``expert_load/layer_NN`` (a layer's busiest expert over the mean per expert) and, at the logged steps,
``metrics/expert_load.jsonl`` (each expert's share of a layer's routed tokens).

- :func:`balance_figure`: busiest-over-mean per layer over the steps (1: even);
- :func:`share_figure`: the last logged step's share per layer and expert, as a heatmap.

A dense run has neither file nor metric: :func:`figures` is then empty.
"""

from __future__ import annotations

import re

from qwenkit.engine.run import expert_load, metrics
from qwenkit.notebooks import plots

_LAYER = re.compile(r"expert_load/layer_(\d+)")


def balance_figure(run_dir):
    """``expert_load/layer_NN`` over the steps, one line per layer (rank 0's rows: every rank logs the global counts)."""
    rows = [r for r in metrics.read(run_dir) if r.get("rank", 0) == 0 and _LAYER.fullmatch(r["metric"])]
    curves: dict[str, list[tuple[float, float]]] = {}
    for r in sorted(rows, key=lambda r: r["x"]):
        curves.setdefault(f"layer {int(_LAYER.fullmatch(r['metric']).group(1))}", []).append((r["x"], r["value"]))
    styles = {name: {"colour": plots.COLOURS[i % len(plots.COLOURS)], "dash": "solid"} for i, name in enumerate(curves)}
    return plots.run_curves(curves, styles, "busiest expert / mean per expert",
                            "Expert load per layer (1 = even)")  # fmt: skip


def share_figure(run_dir):
    """The last logged step's fraction of each layer's routed tokens per expert."""
    last = expert_load.read(run_dir)[-1]
    return plots.heatmap(last["fractions"], "expert", "layer", "share",
                         f"Share of routed tokens per expert at step {last['step']}")  # fmt: skip


def figures(run_dir) -> list:
    """Notebook 02's MoE figures for the run at ``run_dir``; none for a dense run."""
    if not expert_load.read(run_dir):
        return []
    return [balance_figure(run_dir), share_figure(run_dir)]
