"""Notebook 05's computations: many runs side by side (a sweep's trials, or any run folders).

:func:`collect` reads each run's ``config.yaml``, metrics JSONL and (for a sweep) its ledger
row; the keys whose values differ between the runs are the *varied* keys (``train.output_dir``
aside). :func:`save` writes what every figure is drawn from:

- ``curves.csv``: loss, eval loss and eval accuracy per step (rank 0), one series per run;
- ``final_metrics.csv``: the final metrics of each run (:data:`qwenkit.engine.run.metrics.FINAL`);
- ``runs.json``: each run's varied values, status and full config, and the ranking;
- ``metrics.json``: the summary line (best run by ``rank_by``) and the ranking.

The figures (:func:`figures`) read only those files.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import yaml

from qwenkit import config as qconfig
from qwenkit.engine.run import metrics
from qwenkit.notebooks import plots, results
from qwenkit.rundir import RunDir
from qwenkit.sweep import ledger

CURVES, FINALS, RUNS = "curves.csv", "final_metrics.csv", "runs.json"
CURVE_METRICS = {"loss": "training loss", "eval_loss": "eval loss (held-out)", "eval_accuracy": "eval accuracy"}
IGNORED_KEYS = ("train.output_dir",)  # differs between any two runs, says nothing
SEED_KEY = "train.seed"
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")


def run_folders(sweep_dir: str | Path | None = None, run_dirs: list[str | Path] = ()) -> list[Path]:
    """The sweep's trial folders in the ledger's order, or ``run_dirs`` as given."""
    if sweep_dir:
        rows = ledger.latest(sweep_dir)
        if not rows:
            raise FileNotFoundError(f"{Path(sweep_dir) / ledger.LEDGER}: no ledger; run `qwenkit sweep run` first")
        return [Path(r.get("output_dir") or Path(sweep_dir) / name) for name, r in rows.items()]
    if not run_dirs:
        raise ValueError("compare what? give a sweep folder or run folders")
    missing = [str(d) for d in run_dirs if not RunDir(d).config.is_file()]
    if missing:
        raise FileNotFoundError(f"not a qwenkit run folder (no config.yaml): {', '.join(missing)}")
    return [Path(d) for d in run_dirs]


def collect(folders: list[Path], sweep_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """One record per run: name, folder, status, config (flat), final metrics, curves."""
    rows = ledger.latest(sweep_dir) if sweep_dir else {}
    runs = []
    for folder in folders:
        entry = rows.get(folder.name, {})
        cfg_path = RunDir(folder).config
        config = metrics.flatten(qconfig.parse_yaml(cfg_path.read_text(), str(cfg_path))) if cfg_path.is_file() else {}
        wall = (entry.get("metrics") or {}).get("wall_time")
        runs.append({
            "name": folder.name, "folder": str(folder), "status": entry.get("status", "done" if config else "missing"),
            "error": entry.get("error"), "config": config, "final": metrics.final_metrics(folder, wall),
            "rows": metrics.read(folder) if (folder / "metrics").is_dir() else [],
        })  # fmt: skip
    keys = sorted({k for r in runs for k in r["config"]} - set(IGNORED_KEYS))
    varied = [k for k in keys if len({json.dumps(r["config"].get(k)) for r in runs}) > 1]
    order = list(dict.fromkeys(k for e in rows.values() for k in (e.get("varied") or {})))  # the sweep file's order
    varied.sort(key=lambda k: (order.index(k) if k in order else len(order), k))
    for r in runs:
        r["varied"] = {k: r["config"].get(k) for k in varied}
    return runs


def ranking(finals: dict[str, dict[str, Any]], rank_by: str) -> list[str]:
    """Run names, best first by ``rank_by`` (lower is better for losses, times and memory); runs
    without that metric last."""
    if rank_by not in metrics.FINAL:
        raise ValueError(f"rank_by={rank_by!r}: expected one of {', '.join(metrics.FINAL)}")
    sign = 1 if rank_by in metrics.LOWER_IS_BETTER else -1
    have = [n for n, f in finals.items() if isinstance(f.get(rank_by), (int, float))]
    rest = [n for n in finals if n not in have]
    return sorted(have, key=lambda n: sign * finals[n][rank_by]) + rest


def save(out_dir: str | Path, runs: list[dict[str, Any]], rank_by: str) -> dict[str, Any]:
    """Write the result files (see the module docstring); returns metrics.json's values."""
    out = Path(out_dir)
    curves = []
    for r in runs:
        for metric in CURVE_METRICS:
            for step, value in sorted(metrics.series(r["rows"], metric).items()):
                curves.append(results.record(metric, value, unit=metrics.UNITS[metric], series=r["name"],
                                             x_name="step", x=step))  # fmt: skip
    results.write_csv(curves, out / CURVES)
    finals = []
    for r in runs:
        for key, (_, unit) in metrics.FINAL.items():
            if isinstance(r["final"].get(key), (int, float)):
                finals.append(results.record(key, r["final"][key], unit=unit, series=r["name"]))
    results.write_csv(finals, out / FINALS)
    order = ranking({r["name"]: r["final"] for r in runs}, rank_by)
    doc = {
        "rank_by": rank_by, "ranking": order,
        "varied": list(runs[0]["varied"]) if runs else [],
        "runs": {r["name"]: {"status": r["status"], "error": r["error"], "folder": r["folder"],
                             "varied": r["varied"], "config": r["config"]} for r in runs},
    }  # fmt: skip
    (out / RUNS).write_text(json.dumps(doc, indent=1) + "\n")
    best = order[0] if order else None
    by = {r["name"]: r["final"].get(rank_by) for r in runs}
    done = [r for r in runs if r["status"] == "done"]
    values = {
        "runs": len(runs), "done": len(done), "rank_by": rank_by, "ranking": order, "best": best,
        "best_value": by.get(best), "worst": order[-1] if order else None, "worst_value": by.get(order[-1]) if order else None,
        "varied": doc["varied"], rank_by: by,
    }  # fmt: skip
    numbers = isinstance(values["best_value"], (int, float)) and isinstance(values["worst_value"], (int, float))
    spread = f"{values['best_value']:.3g} vs {values['worst_value']:.3g} ({values['worst']})" if numbers and len(order) > 1 else ""
    summary = (f"{len(runs)} runs ranked by {rank_by}, varying {', '.join(doc['varied']) or 'nothing'}: "
               f"best {best} {spread}")  # fmt: skip
    passed = bool(runs) and len(done) == len(runs) and all(isinstance(v, (int, float)) for v in by.values())
    results.write_metrics(out, "05_compare_runs", summary, passed, **values)
    return values


# ---------------------------------------------------------------------------------------------
# Figures, from the result files alone


def _doc(out_dir) -> dict[str, Any]:
    return json.loads((Path(out_dir) / RUNS).read_text())


def styles(doc: dict[str, Any], colour_by: str = "", dash_by: str = "") -> dict[str, dict[str, Any]]:
    """Each run's line colour (by the value of ``colour_by``, default the first varied key) and
    dash (by ``dash_by``, default the next varied key, the seed last)."""
    varied = doc["varied"]
    keys = [k for k in varied if k != SEED_KEY] + [k for k in varied if k == SEED_KEY]
    colour_by = colour_by or (keys[0] if keys else "")
    dash_by = dash_by or next((k for k in keys if k != colour_by), "")
    for key in (colour_by, dash_by):
        if key and key not in varied:
            raise ValueError(f"{key!r} is not a varied key; varied: {', '.join(varied) or 'none'}")
    out = {}
    for key, palette, field in ((colour_by, plots.COLOURS, "colour"), (dash_by, DASHES, "dash")):
        values = list(dict.fromkeys(json.dumps(r["varied"].get(key)) for r in doc["runs"].values())) if key else []
        for i, (name, r) in enumerate(doc["runs"].items()):
            slot = values.index(json.dumps(r["varied"].get(key))) if key else (i if field == "colour" else 0)
            out.setdefault(name, {})[field] = palette[slot % len(palette)]
    return out


def curves_figure(out_dir, metric: str, colour_by: str = "", dash_by: str = "") -> go.Figure:
    """One line per run of ``metric`` over steps; colour and dash by two varied keys."""
    doc = _doc(out_dir)
    rows = results.select(results.read_csv(Path(out_dir) / CURVES), metric=metric)
    curves = {name: sorted((r["x"], r["value"]) for r in rows if r["series"] == name) for name in doc["runs"]}
    return plots.run_curves(curves, styles(doc, colour_by, dash_by), f"{CURVE_METRICS[metric]} ({metrics.UNITS[metric]})",
                            f"{CURVE_METRICS[metric]} of every run", [0, 1.05] if metric == "eval_accuracy" else None)  # fmt: skip


def final_table(out_dir) -> go.Figure:
    """The final metrics of every run, best first by the ranking metric."""
    doc = _doc(out_dir)
    finals = results.read_csv(Path(out_dir) / FINALS)
    by = {(r["series"], r["metric"]): r["value"] for r in finals}
    columns = ["rank", "run", "status", *doc["varied"], *(label for label, _ in metrics.FINAL.values())]
    table = []
    for i, name in enumerate(doc["ranking"], 1):
        run = doc["runs"][name]
        row = {"rank": i, "run": name, "status": run["status"]}
        row.update({k: json.dumps(v) if isinstance(v, (list, dict, bool)) or v is None else v for k, v in run["varied"].items()})
        for key, (label, _) in metrics.FINAL.items():
            row[label] = by.get((name, key), float("nan"))
        table.append(row)
    formats = {label: ".4g" for label, _ in metrics.FINAL.values()}
    formats.update({"trainable params": ",.0f", "steps": ".0f", "wall time": ".1f"})
    return plots.table(table, columns, title=f"Final metrics, ranked by {doc['rank_by']}", formats=formats)


def effect_figure(out_dir) -> go.Figure:
    """The ranking metric against each varied key's values (the seed aside): one marker per run,
    the mean over the other keys and seeds as a line, their min-max as the error bar."""
    doc = _doc(out_dir)
    metric = doc["rank_by"]
    value = {r["series"]: r["value"] for r in results.select(results.read_csv(Path(out_dir) / FINALS), metric=metric)}
    keys = [k for k in doc["varied"] if k != SEED_KEY] or doc["varied"][:1]
    groups: dict[str, dict[str, list[float]]] = {}
    for key in keys:
        for name, run in doc["runs"].items():
            if name in value:
                groups.setdefault(key, {}).setdefault(json.dumps(run["varied"].get(key)), []).append(value[name])
    label = metrics.FINAL[metric][0]
    return plots.metric_effect(groups, label, f"Effect of each varied key on {label}")


def winner_html(out_dir) -> str:
    """The best run's varied values and its whole config (the YAML every rank read), as HTML."""
    doc = _doc(out_dir)
    if not doc["ranking"]:
        return "<p>no runs</p>"
    name = doc["ranking"][0]
    run = doc["runs"][name]
    varied = ", ".join(f"<code>{html.escape(k)}={html.escape(json.dumps(v))}</code>" for k, v in run["varied"].items())
    cfg = yaml.safe_dump(run["config"], sort_keys=False)
    return (f"<p><b>Best by {html.escape(doc['rank_by'])}: {html.escape(name)}</b> ({varied or 'nothing varied'}); "
            f"folder <code>{html.escape(run['folder'])}</code></p>"
            f"<details><summary>its config ({len(run['config'])} keys)</summary><pre>{html.escape(cfg)}</pre></details>")  # fmt: skip


def figures(out_dir, colour_by: str = "", dash_by: str = "") -> list[go.Figure]:
    """Every figure of notebook 05, in the order it shows them."""
    return [final_table(out_dir), *(curves_figure(out_dir, m, colour_by, dash_by) for m in CURVE_METRICS),
            effect_figure(out_dir)]  # fmt: skip
