"""Notebook 02's GRPO branch: a ``train.objective: grpo`` run's rewards over its steps and the completions that changed.

The run (``<output_dir>/grpo``, started from the uninterrupted SFT run like the DPO run) writes
TRL's metrics per step (:mod:`qwenkit.engine.run.metrics`: ``reward``, ``reward_std``,
``rewards/<name>/mean``, ``kl``, ``entropy``, ``completions/mean_length``,
``frac_reward_zero_std``) and, at each logged step, a sample of rank 0's completions with their
rewards (``metrics/completions.jsonl``, :mod:`qwenkit.engine.objectives.grpo`). From those files alone:

- :func:`reward_figure`: the mean reward with its within-group spread (``reward_std``) as a band,
  and each reward's mean; :func:`diagnostics_figure`: KL to the reference, entropy, mean completion
  length and the share of groups whose rewards were all equal (no advantage, no gradient);
  :func:`time_figure`: each step's time split into its rollout (``rollout_time``: sampling the
  completions, 0 on a step that reuses its cycle's rollout) and the rest (rewards, log-probs, learner);
- :func:`save_changed` pairs, for each prompt (dataset row ``index``) rank 0 rolled out at two
  different steps, its completions and rewards at the first and the last of them into
  ``grpo_completions.jsonl`` here; :func:`changed_table` shows them, largest reward change first;
- :func:`save` adds the run's headline numbers to the notebook's ``metrics.json``;
  :func:`check_config` refuses a ``grpo_config`` that is not ``train.objective: grpo`` before any run.

:func:`completions` is the one reader of the completion records (a record's step or rollout).

Cannot: show the other ranks' completions (rank 0 writes a sample of its share), nor the steps
between two logged ones (``train.log_every``).
"""

from __future__ import annotations

import html
import statistics
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import yaml
from plotly.subplots import make_subplots

from qwenkit import config as qconfig
from qwenkit import records
from qwenkit.engine.objectives.completions import SAMPLE_FILE, read_completions
from qwenkit.engine.run import metrics
from qwenkit.engine.run.metrics import series
from qwenkit.notebooks import plots, results
from qwenkit.rundir import RunDir

GRPO = "grpo"  # the GRPO run's folder in output_dir, started from the uninterrupted run (grpo_config)
CHANGED = "grpo_completions.jsonl"  # the prompts rolled out early and late: completions and rewards then and now
NONE_AGAIN = ": none yet (a prompt comes back once the run passes an epoch of its data; more train.steps)"
DIAGNOSTICS = {"kl": "KL to the reference (nats)", "entropy": "entropy (nats per token)",
               "completions/mean_length": "mean completion length (tokens)",
               "frac_reward_zero_std": "groups with equal rewards (share)"}  # fmt: skip


def check_config(path, overrides: list[str]) -> None:
    """Refuse, before any run starts, a ``grpo_config`` that is no valid config or whose
    ``train.objective`` (with ``overrides``) is not ``grpo``: one line naming the file."""
    cfg = qconfig.load(path, overrides)
    if cfg.train.objective != "grpo":
        raise ValueError(f"grpo_config={path}: train.objective is {cfg.train.objective!r}, not grpo")


def completions(run_dir) -> tuple[str, list[dict[str, Any]]]:
    """The run's completion records, each with ``x``: its optimizer ``step`` where the record has
    one (read by :func:`qwenkit.engine.objectives.completions.read_completions`: a step written twice keeps its last
    write), else its ``rollout`` number (files written before records had steps; a rollout written
    again after others keeps its last writing); returns the x axis's name and the records."""
    rows = records.read_jsonl(Path(run_dir) / "metrics" / SAMPLE_FILE)
    if rows and "step" in rows[0]:
        by_step = read_completions(run_dir)
        return "step", [{**r, "x": step} for step in sorted(by_step) for r in by_step[step]]
    by_x: dict[int, list[dict[str, Any]]] = {}
    last = None
    for r in rows:
        x = r["rollout"]
        if x != last and x in by_x:  # this rollout again, after others: the earlier writing is stale
            by_x[x] = []
        by_x.setdefault(x, []).append({**r, "x": x})
        last = x
    return "rollout", [r for x in sorted(by_x) for r in by_x[x]]


def _config(run_dir) -> dict[str, Any]:
    return yaml.safe_load(RunDir(run_dir).config.read_text())


def reward_weights(run_dir) -> dict[str, float]:
    """``{reward name: weight}`` of the run's resolved config (``grpo.reward_weights``; none: all 1)."""
    grpo = _config(run_dir)["grpo"]
    names = [str(n).rsplit(":", 1)[-1] for n in grpo["rewards"]]  # module:function is logged as function
    return dict(zip(names, grpo["reward_weights"] or [1.0] * len(names)))


def _group(rows: list[dict[str, Any]], weights: dict[str, float]) -> dict[str, Any]:
    """One prompt's completions at one step, each with its weighted ``reward``, and their mean."""
    done = [{"completion": r["completion"], "rewards": r["rewards"], "truncated": r["truncated"],
             "reward": sum(weights.get(k, 1.0) * v for k, v in r["rewards"].items())} for r in rows]  # fmt: skip
    return {"x": rows[0]["x"], "completions": done, "reward": statistics.fmean(c["reward"] for c in done)}


def changed_rows(run_dir) -> list[dict[str, Any]]:
    """Per prompt rolled out at two steps or more: its first (``early``) and last (``late``) group,
    largest change of the mean reward first."""
    name, rows = completions(run_dir)
    weights = reward_weights(run_dir)
    groups: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for r in rows:
        groups.setdefault(r["index"], {}).setdefault(r["x"], []).append(r)
    out = []
    for index, at in groups.items():
        if len(at) < 2:
            continue
        early, late = _group(at[min(at)], weights), _group(at[max(at)], weights)
        out.append({"index": index, "reference": at[min(at)][0]["reference"], "x_name": name, "early": early,
                    "late": late, "change": late["reward"] - early["reward"]})  # fmt: skip
    return sorted(out, key=lambda r: (-abs(r["change"]), r["index"]))


def save_changed(out_dir, run_dir) -> list[dict[str, Any]]:
    """:func:`changed_rows` of ``run_dir`` into ``<out_dir>/grpo_completions.jsonl``; returns them."""
    rows = changed_rows(run_dir)
    results.write_jsonl(rows, Path(out_dir) / CHANGED)
    return rows


def _completion_cells(group: dict[str, Any]) -> str:
    items = "".join(
        f"<li><code>{html.escape(c['completion'])}</code> <b>{c['reward']:.2f}</b>"
        + (" (cut)" if c["truncated"] else "") + "</li>"
        for c in group["completions"]
    )  # fmt: skip
    return f"<td><ol style='margin:0;padding-left:1.2em'>{items}</ol>mean {group['reward']:.2f}</td>"


def changed_table(out_dir, limit: int = 8):
    """The first ``limit`` rows of ``grpo_completions.jsonl`` as an HTML table: the reference, then
    the completions with their (weighted) rewards at the first and the last step the prompt was seen."""
    from IPython.display import HTML

    rows = records.read_jsonl(Path(out_dir) / CHANGED)
    x = rows[0]["x_name"] if rows else "step"
    cells = "".join(
        f"<tr><td>{r['index']}</td><td>{html.escape(r['reference'])}</td>"
        f"<td>{x} {r['early']['x']}</td>{_completion_cells(r['early'])}"
        f"<td>{x} {r['late']['x']}</td>{_completion_cells(r['late'])}</tr>"
        for r in rows[:limit]
    )  # fmt: skip
    head = ("<tr><th>row</th><th>reference</th><th>early</th><th>completions then</th><th>late</th>"
            "<th>completions now</th></tr>")  # fmt: skip
    return HTML(f'<table class="grpo-completions">{head}{cells}</table>'
                f"<p>{min(limit, len(rows))} of {len(rows)} prompts rank 0 rolled out at two {x}s or more, "
                f"largest change of the mean reward first{'' if rows else NONE_AGAIN}</p>")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Figures, drawn from the run's metric files alone


def reward_names(rows: list[dict[str, Any]]) -> list[str]:
    """The rewards the run logged (``rewards/<name>/mean``), in their logged order."""
    seen = dict.fromkeys(r["metric"][len("rewards/"):-len("/mean")] for r in rows
                         if r["metric"].startswith("rewards/") and r["metric"].endswith("/mean"))  # fmt: skip
    return list(seen)


def reward_figure(run_dir) -> go.Figure:
    """The mean reward of each step's completions, ± its within-group spread (``reward_std``), and
    each reward's own mean (unweighted)."""
    rows = metrics.read(run_dir)
    reward, spread = series(rows, "reward"), series(rows, "reward_std")
    steps = sorted(reward)
    upper = [reward[s] + spread.get(s, 0.0) for s in steps]
    lower = [reward[s] - spread.get(s, 0.0) for s in steps]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=steps + steps[::-1], y=upper + lower[::-1], fill="toself", name="reward ± reward_std",
                             line_width=0, fillcolor="rgba(31,119,180,0.2)", hoverinfo="skip"))  # fmt: skip
    fig.add_trace(go.Scatter(x=steps, y=[reward[s] for s in steps], name="reward (weighted sum)", mode="lines+markers",
                             line_color=plots.COLOURS[0]))  # fmt: skip
    for k, name in enumerate(reward_names(rows)):
        mean = series(rows, f"rewards/{name}/mean")
        fig.add_trace(go.Scatter(x=sorted(mean), y=[mean[s] for s in sorted(mean)], name=f"rewards/{name}/mean",
                                 mode="lines", line=dict(color=plots.COLOURS[(k + 1) % len(plots.COLOURS)], dash="dot")))  # fmt: skip
    fig.update_xaxes(title_text="GRPO step")
    fig.update_yaxes(title_text="reward")
    fig.update_layout(title="GRPO: the rollouts' reward over the steps", height=420, legend_title_text="",
                      margin=dict(l=60, r=20, t=70, b=50))  # fmt: skip
    return fig


def diagnostics_figure(run_dir) -> go.Figure:
    """KL to the reference (logged with ``grpo.beta > 0``), entropy, mean completion length and
    ``frac_reward_zero_std`` over the steps, one panel each."""
    rows = metrics.read(run_dir)
    fig = make_subplots(rows=2, cols=2, subplot_titles=list(DIAGNOSTICS.values()))
    for k, name in enumerate(DIAGNOSTICS):
        values = series(rows, name)
        fig.add_trace(go.Scatter(x=sorted(values), y=[values[s] for s in sorted(values)], name=name, mode="lines+markers",
                                 line_color=plots.COLOURS[k]), row=k // 2 + 1, col=k % 2 + 1)  # fmt: skip
    fig.update_xaxes(title_text="GRPO step")
    fig.update_layout(title="GRPO: KL, entropy, completion length, groups without signal", height=560,
                      legend_title_text="", margin=dict(l=60, r=20, t=70, b=50))  # fmt: skip
    return fig


def time_figure(run_dir) -> go.Figure:
    """Rank 0's step time per GRPO step, stacked: the rollout (``rollout_time``) and the rest of the step."""
    rows = metrics.read(run_dir)
    rollout, step = series(rows, "rollout_time"), series(rows, "step_time")
    steps = sorted(set(rollout) & set(step))
    fig = go.Figure()
    fig.add_trace(go.Bar(x=steps, y=[rollout[s] for s in steps], name="rollout (sampling the completions)",
                         marker_color=plots.COLOURS[0]))  # fmt: skip
    fig.add_trace(go.Bar(x=steps, y=[step[s] - rollout[s] for s in steps], name="rewards, log-probs, learner",
                         marker_color=plots.COLOURS[1]))  # fmt: skip
    share = rollout_share(rows)
    fig.update_layout(barmode="stack", title=f"GRPO: time per step (rollout {share:.0%} of it)", height=380,
                      xaxis_title="GRPO step", yaxis_title="seconds (rank 0)", margin=dict(l=60, r=20, t=60, b=50))  # fmt: skip
    return fig


def rollout_share(rows: list[dict]) -> float:
    """Rank 0's rollout time over its step time, summed over the steps (nan without steps)."""
    rollout, step = series(rows, "rollout_time"), series(rows, "step_time")
    total = sum(step[s] for s in rollout if s in step)
    return sum(rollout[s] for s in rollout if s in step) / total if total else float("nan")


def figures(out_dir) -> list:
    """The GRPO branch's figures, in the order notebook 02 shows them."""
    run = Path(out_dir) / GRPO
    return [reward_figure(run), diagnostics_figure(run), time_figure(run)]


# ---------------------------------------------------------------------------------------------
# The notebook's headline


def _window_means(values: dict[int, float]) -> tuple[float, float, int]:
    """The mean of the first and of the last fifth of the steps (at least one step each), and its length."""
    steps = sorted(values)
    if not steps:
        return float("nan"), float("nan"), 0
    n = max(1, len(steps) // 5)
    return (statistics.fmean(values[s] for s in steps[:n]), statistics.fmean(values[s] for s in steps[-n:]), n)


def values(run_dir, changed: list[dict[str, Any]]) -> dict[str, Any]:
    """The GRPO run's numbers for ``metrics.json``: steps; the mean reward (each reward's too) over
    the first and the last fifth of the steps (one step's reward is the mean of a few groups: too
    noisy to compare two single steps); the KL at its first step (0: the policy starts as its
    reference); how many prompts :func:`changed_rows` paired."""
    rows = metrics.read(run_dir)
    first, last, window = _window_means(series(rows, "reward"))
    out: dict[str, Any] = {"grpo_steps": len(series(rows, "reward")), "grpo_rewards": reward_names(rows),
                           "grpo_reward_window": window, "grpo_first_reward": first, "grpo_last_reward": last,
                           "grpo_changed_prompts": len(changed)}  # fmt: skip
    for name in out["grpo_rewards"]:
        out[f"grpo_first_{name}"], out[f"grpo_last_{name}"], _ = _window_means(series(rows, f"rewards/{name}/mean"))
    kl = series(rows, "kl")
    out["grpo_first_kl"] = kl[min(kl)] if kl else None  # None: grpo.beta = 0, no reference
    out["grpo_rollout_share"] = rollout_share(rows)
    return out


def save(out_dir, run_dir) -> dict[str, Any]:
    """Add the GRPO run's :func:`values` to ``<out_dir>/metrics.json`` (written by
    :func:`qwenkit.notebooks.runs.save`) and a clause to its summary. It passes when each of the
    run's ``train.steps`` logged its reward and the first step's KL is 0 where it was logged. Whether
    the reward rose (``grpo_reward_rose``) and how many prompts came back (``grpo_changed_prompts``:
    none before the run passes an epoch of its data) are recorded, not required: a few steps (the
    smoke set) need not move the reward."""
    doc = results.read_metrics(out_dir)
    v = values(run_dir, records.read_jsonl(Path(out_dir) / CHANGED))
    v["grpo_reward_rose"] = v["grpo_last_reward"] > v["grpo_first_reward"]
    ok = v["grpo_steps"] == _config(run_dir)["train"]["steps"] and v["grpo_first_kl"] in (None, 0.0)
    n = v["grpo_reward_window"]
    summary = (f"{doc['summary']}; GRPO {v['grpo_steps']} steps: mean reward {v['grpo_first_reward']:.2f} "
               f"(first {n} steps) -> {v['grpo_last_reward']:.2f} (last {n}), "
               f"{v['grpo_changed_prompts']} prompts seen early and late")  # fmt: skip
    values_all = {**doc["values"], **v}
    results.write_metrics(out_dir, doc["notebook"], summary, doc["passed"] and ok, **values_all)
    return values_all
