"""Training runs started from a notebook: ``qwenkit train`` as a child process, followed and stopped.

The kernel never trains: FSDP2 needs one process per rank, and a kernel that joined a process
group could not be re-run. :func:`train` starts ``qwenkit train`` (the launcher, then torchrun,
then the ranks) in its own process group (:class:`qwenkit.engine.run.child.TrainProcess`), shows its
events in the cell, keeps the whole log in ``<output_dir>/train.log``, and can start a run from
another run's checkpoint (``resume_from``: ``train.resume=<checkpoint>``, checked in the run's
events to have resumed there).

:func:`qwenkit.engine.run.metrics.read` reads the per-rank JSONL files the trainer writes; :func:`summary_rows`
and :func:`save` turn them into the notebook's table and result files; the held-out rows'
answers before and after training are :mod:`qwenkit.notebooks.gallery`'s.
"""

from __future__ import annotations

import os
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.run import events, metrics
from qwenkit.engine.run.child import TrainProcess
from qwenkit.engine.run.metrics import series
from qwenkit.notebooks import experts, gallery, grpo, plots, results
from qwenkit.rundir import RunDir


@dataclass
class TrainRun:
    output_dir: Path
    command: list[str]
    returncode: int
    seconds: float
    log: Path
    resumed_from: int | None = None  # the step of the checkpoint this run resumed from (None: fresh)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def fresh_dir(path: str | Path) -> Path:
    """An empty run directory; a previous *qwenkit run* there is removed, anything else refused."""
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        if not RunDir(path).is_run():
            raise FileExistsError(f"{path} is not empty and holds no qwenkit run; not removing it")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def train_command(config: str | Path, output_dir: str | Path, nproc: int, overrides: list[str]) -> list[str]:
    """``qwenkit train`` with this Python (the kernel's environment) and the run's output_dir (on one
    node ``qwenkit train`` takes a free rendezvous port, so runs never collide with other jobs)."""
    return [
        sys.executable, "-m", "qwenkit.cli", "train", "--config", str(config), "--nproc", str(nproc),
        *overrides, f"train.output_dir={output_dir}",
    ]  # fmt: skip


def checkpoint_of(run_dir: str | Path, step: int) -> Path:
    """The folder of ``run_dir``'s checkpoint of ``step`` (complete or not)."""
    return ckpt.step_dir(ckpt.checkpoint_root(run_dir), step)


def train(
    config: str | Path,
    output_dir: str | Path,
    nproc: int = 2,
    overrides: list[str] | None = None,
    echo: Callable[[str], None] = print,
    timeout_s: float = 900,
    resume_from: str | Path | None = None,
) -> TrainRun:
    """Run ``qwenkit train`` to the end; ``resume_from``: start from that checkpoint (another
    run's; this run's own are found by ``train.resume=auto``). ``echo`` gets the command and one
    line per event of the run (:func:`qwenkit.engine.run.events.describe`); with an ``event`` method
    (:class:`qwenkit.notebooks.progress.RunLog`), that gets the events themselves too."""
    output_dir = Path(output_dir)
    overrides = list(overrides or []) + ([f"train.resume={resume_from}"] if resume_from is not None else [])
    cmd = train_command(config, output_dir, nproc, overrides)
    echo("$ qwenkit " + shlex.join(cmd[3:]))
    on_event = getattr(echo, "event", None)

    def shown(event: dict[str, Any]) -> None:  # called in this thread: a notebook shows only its own thread's output
        if on_event is not None:
            on_event(event)
        if event["event"] != "started":
            echo(events.describe(event))

    t0 = time.perf_counter()
    child = TrainProcess(cmd, output_dir, dict(os.environ))
    code = child.follow(on_event=shown, timeout_s=timeout_s)
    log_path = child.run_dir.train_log
    run = TrainRun(output_dir, cmd, code, time.perf_counter() - t0, log_path, events.resumed_step(child.events.seen))
    if not run.ok:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"qwenkit train failed with exit code {code}; last lines of {log_path}:\n{tail}")
    if resume_from is not None and run.resumed_from is None:
        raise RuntimeError(f"the run did not resume from {resume_from}; log: {log_path}")
    echo(f"-- finished after {run.seconds:.0f} s")
    return run


COMPARISON = "lora_comparison.csv"


def comparison_rows(run_dirs: dict[str, str | Path]) -> list[dict[str, Any]]:
    """One row per run: total and trainable parameters, newest checkpoint's size, the peak memory
    and median step time of :func:`qwenkit.engine.run.metrics.final_metrics` (the largest peak of any
    rank, rank 0's median), held-out accuracy at the first and last evaluation."""
    out = []
    for name, run_dir in run_dirs.items():
        run_dir = Path(run_dir)
        total, trainable = RunDir(run_dir).parameter_counts() or (0, 0)
        step = ckpt.latest(ckpt.checkpoint_root(run_dir))
        size = sum(f.stat().st_size for f in step.rglob("*") if f.is_file()) if step is not None else 0
        final = metrics.final_metrics(run_dir)  # the sweep's numbers too: one definition of each
        acc = series(metrics.read(run_dir), "eval_accuracy")
        out.append({
            "run": name, "trainable parameters": trainable, "total parameters": total,
            "checkpoint (MiB)": size / 2**20,
            "max peak memory (MiB)": _or_nan(final["peak_memory"]),
            "median step time (s)": _or_nan(final["step_time"]),
            "first accuracy": acc[min(acc)] if acc else float("nan"),
            "last accuracy": acc[max(acc)] if acc else float("nan"),
        })  # fmt: skip
    return out


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


COMPARISON_UNITS = {"trainable parameters": "1", "total parameters": "1", "checkpoint (MiB)": "MiB",
                    "max peak memory (MiB)": "MiB", "median step time (s)": "s", "first accuracy": "1",
                    "last accuracy": "1"}  # fmt: skip


def save_comparison(out_dir, run_dirs: dict[str, str | Path]) -> list[dict[str, Any]]:
    """:func:`comparison_rows` written to ``<out_dir>/lora_comparison.csv`` (long format, one row per
    run and quantity, ``series`` = the run); returns the rows."""
    rows = comparison_rows(run_dirs)
    long = [results.record(metric, row[metric], unit=unit, series=row["run"])
            for row in rows for metric, unit in COMPARISON_UNITS.items()]  # fmt: skip
    results.write_csv(long, Path(out_dir) / COMPARISON)
    return rows


def comparison_table(rows: list[dict[str, Any]]):
    return plots.table(rows, list(rows[0]), title="LoRA vs full fine-tune",
                       formats={"checkpoint (MiB)": ".2f", "max peak memory (MiB)": ".0f"})  # fmt: skip


def summary_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: steps, first and last loss, median step time and tokens/s, max peak memory."""
    out = []
    for rank in sorted({r.get("rank", 0) for r in rows}):
        loss = series(rows, "loss", rank)
        step_time = list(series(rows, "step_time", rank).values())
        tps = list(series(rows, "tokens_per_s", rank).values())
        mem = series(rows, "peak_memory", rank).values()
        out.append({
            "rank": rank,
            "steps": len(loss),
            "first loss": loss[min(loss)] if loss else float("nan"),
            "last loss": loss[max(loss)] if loss else float("nan"),
            "median step time (s)": statistics.median(step_time) if step_time else float("nan"),
            "median tokens/s": statistics.median(tps) if tps else float("nan"),
            "max peak memory (MiB)": max(mem, default=float("nan")),
        })  # fmt: skip
    return out


def save(out_dir, uninterrupted: list[dict[str, Any]], resumed: list[dict[str, Any]], resume_step: int,
         resumed_run: TrainRun, dpo_run: TrainRun | None = None) -> dict[str, Any]:  # fmt: skip
    """``training_metrics.csv`` (both runs, long format) and ``metrics.json``; returns the metrics' values.

    ``resumed`` is a run that resumed from the uninterrupted run's checkpoint of ``resume_step``:
    every step after it, and every evaluation after it, must equal the uninterrupted run's.
    ``dpo_run``: a DPO run started from the uninterrupted one (:func:`dpo_values`); it passes when
    it evaluated its held-out pairs at step 0 and at its end and started at its reference (step 0's
    reward margin and accuracy are 0: the policy is the reference there). Whether the margin grew
    is recorded (``dpo_margin_grew``), not required: a few steps from a few-step SFT run (the smoke
    set) need not move held-out pairs.
    """
    rows = [{**r, "series": f"uninterrupted {r['series']}"} for r in uninterrupted]
    rows += [{**r, "series": f"resumed {r['series']}"} for r in resumed]
    results.write_csv(rows, f"{out_dir}/training_metrics.csv")
    diffs, compared, missing = [], 0, 0
    for name in ("loss", "eval_loss", "eval_accuracy"):
        a, b = series(uninterrupted, name), series(resumed, name)
        after = [s for s in sorted(a) if s > resume_step]
        compared += len(after)
        missing += len([s for s in after if s not in b])
        diffs += [abs(a[s] - b[s]) for s in after if s in b]
    diff = max(diffs, default=float("nan"))
    a = series(uninterrupted, "loss")
    steps = sorted(a)
    values = {
        "steps": len(steps),
        "ranks": len({r.get("rank", 0) for r in uninterrupted}),
        "first_loss": a[steps[0]] if steps else float("nan"),
        "last_loss": a[steps[-1]] if steps else float("nan"),
        "resumed_from": resumed_run.resumed_from,
        "resumed_steps": len([s for s in series(resumed, "loss") if s > resume_step]),
        "resume_max_abs_diff": diff,
    }
    for name in ("eval_loss", "eval_accuracy"):  # the trainer's held-out evaluations, step 0 and the end
        ev = series(uninterrupted, name)
        values[f"{name}_steps"] = sorted(ev)
        values[f"first_{name}"] = ev[min(ev)] if ev else float("nan")
        values[f"last_{name}"] = ev[max(ev)] if ev else float("nan")
    values["loss_decreased"] = bool(steps) and values["last_loss"] < values["first_loss"]
    values["resume_matches"] = compared > 0 and missing == 0 and diff <= 1e-6
    passed = values["loss_decreased"] and values["resume_matches"] and resumed_run.resumed_from == resume_step
    summary = (
        f"{values['ranks']}-rank FSDP2 run, {values['steps']} steps: loss {values['first_loss']:.3f} -> "
        f"{values['last_loss']:.3f}; resumed from step {resume_step}: max |loss diff| vs "
        f"uninterrupted {diff:.1e} over {len(diffs)} values"
    )
    if values["eval_accuracy_steps"]:
        summary += (f"; held-out accuracy {values['first_eval_accuracy']:.2f} -> {values['last_eval_accuracy']:.2f}"
                    f" (step {values['eval_accuracy_steps'][0]} -> {values['eval_accuracy_steps'][-1]})")  # fmt: skip
    if dpo_run is not None:
        values.update(dpo_values(Path(out_dir) / UNINTERRUPTED, dpo_run.output_dir))
        values["dpo_margin_grew"] = values["dpo_last_rewards_margins"] > values["dpo_first_rewards_margins"]
        values["dpo_started_at_reference"] = values["dpo_first_rewards_margins"] == 0 == values["dpo_first_rewards_accuracies"]
        evaluated = len(values["dpo_eval_steps"]) >= 2 and values["dpo_eval_steps"][-1] == values["dpo_steps"]
        passed = passed and evaluated and values["dpo_started_at_reference"]
        summary += (f"; DPO {values['dpo_steps']} steps: held-out preference accuracy "
                    f"{values['dpo_first_logps_accuracies']:.2f} -> {values['dpo_last_logps_accuracies']:.2f}, "
                    f"reward margin {values['dpo_first_rewards_margins']:.2f} -> {values['dpo_last_rewards_margins']:.2f}")
    results.write_metrics(out_dir, "02_sharded_training", summary, passed, **values)
    return values


# ---------------------------------------------------------------------------------------------
# Preference tuning (DPO) from the uninterrupted SFT run

DPO = "dpo"  # the DPO run's folder in output_dir, started from the uninterrupted run (dpo_config)
DPO_ACCURACY = {"policy prefers the chosen reply (eval_logps/accuracies)": "eval_logps/accuracies",
                "reward of chosen > rejected (eval_rewards/accuracies)": "eval_rewards/accuracies"}  # fmt: skip
DPO_MARGINS = {"held-out (eval_rewards/margins)": "eval_rewards/margins", "training (rewards/margins)": "rewards/margins"}


def from_sft_overrides(sft_run: str | Path, recipe: str | Path, steps: int, extra: list[str]) -> list[str]:
    """A DPO or GRPO run's overrides: start from ``sft_run``'s newest checkpoint (``model.init_from``; its
    ``recipe`` is the params file that trained it), ``steps`` optimizer steps (0: the config's own)."""
    return [f"model.init_from={sft_run}", f"model.init_recipe={recipe}", *([f"train.steps={steps}"] if steps else []),
            *extra]  # fmt: skip


def _sft_start(sft_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The SFT run's last held-out evaluation: what DPO starts from."""
    loss, acc = series(sft_rows, "eval_loss"), series(sft_rows, "eval_accuracy")
    return {"step": max(loss, default=None), "eval_loss": loss[max(loss)] if loss else float("nan"),
            "eval_accuracy": acc[max(acc)] if acc else float("nan")}  # fmt: skip


def dpo_values(sft_run: str | Path, dpo_run: str | Path) -> dict[str, Any]:
    """The DPO run's held-out preference metrics at its first (step 0: the SFT start) and last
    evaluation, and the SFT start's own held-out eval loss and exact-match accuracy."""
    rows = metrics.read(dpo_run)
    start = _sft_start(metrics.read(sft_run))
    values: dict[str, Any] = {"dpo_sft_step": start["step"], "dpo_sft_eval_loss": start["eval_loss"],
                              "dpo_sft_eval_accuracy": start["eval_accuracy"],
                              "dpo_steps": len(series(rows, "loss"))}  # fmt: skip
    for name in ("eval_logps/accuracies", "eval_rewards/accuracies", "eval_rewards/margins"):
        ev = series(rows, name)
        key = name.replace("eval_", "").replace("/", "_")
        values["dpo_eval_steps"] = sorted(ev)
        values[f"dpo_first_{key}"] = ev[min(ev)] if ev else float("nan")
        values[f"dpo_last_{key}"] = ev[max(ev)] if ev else float("nan")
    return values


def dpo_table(out_dir):
    """The SFT start beside the DPO run: held-out loss and exact match of the SFT run's last
    evaluation, the held-out preference accuracy and reward margin at DPO's step 0 and its end."""
    v = dpo_values(Path(out_dir) / UNINTERRUPTED, Path(out_dir) / DPO)
    rows = [
        {"model": f"SFT start (uninterrupted run, step {v['dpo_sft_step']})", "held-out eval loss": v["dpo_sft_eval_loss"],
         "held-out exact match": v["dpo_sft_eval_accuracy"], "preference accuracy": v["dpo_first_logps_accuracies"],
         "reward margin": v["dpo_first_rewards_margins"]},
        {"model": f"after DPO (step {v['dpo_eval_steps'][-1]})", "held-out eval loss": float("nan"),
         "held-out exact match": float("nan"), "preference accuracy": v["dpo_last_logps_accuracies"],
         "reward margin": v["dpo_last_rewards_margins"]},
    ]  # fmt: skip
    return plots.table(rows, list(rows[0]), title="Held-out: the SFT start and the DPO run",
                       formats={"held-out eval loss": ".4f", "held-out exact match": ".3f",
                                "preference accuracy": ".3f", "reward margin": ".3f"})  # fmt: skip


def dpo_figure(out_dir):
    """:func:`qwenkit.notebooks.plots.preference_over_training` of the DPO run in ``out_dir``."""
    rows = metrics.read(Path(out_dir) / DPO)
    accuracy = {label: series(rows, name) for label, name in DPO_ACCURACY.items()}
    start = accuracy[next(iter(DPO_ACCURACY))]
    return plots.preference_over_training(accuracy, {label: series(rows, name) for label, name in DPO_MARGINS.items()},
                                          start[min(start)] if start else None)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Figures, drawn from the runs' metric files alone

UNINTERRUPTED, RESUMED = "uninterrupted", "resumed"  # the two runs' folders in output_dir
FULL = "full"  # the full fine-tune beside a LoRA run (lora_r > 0)


def summary_table(run_dir):
    rows = summary_rows(metrics.read(run_dir))
    return plots.table(rows, list(rows[0]), title="Per rank")


def metrics_figure(run_dir, title: str = "Training metrics per rank"):
    return plots.training_metrics(metrics.read(run_dir), title=title)


def resume_figure(out_dir, resume_step: int):
    a, b = (metrics.read(Path(out_dir) / name) for name in (UNINTERRUPTED, RESUMED))
    return plots.resume_overlay(series(a, "loss"), series(b, "loss"), resume_step)


def eval_figures(run_dir) -> list:
    """Held-out eval loss over the training loss, and accuracy at each step it was measured."""
    rows = metrics.read(run_dir)
    return [plots.eval_over_training(series(rows, "loss"), series(rows, "eval_loss")),
            plots.accuracy_before_after(series(rows, "eval_accuracy"))]  # fmt: skip


def figures(out_dir, resume_step: int) -> list:
    """Every figure of notebook 02, in the order it shows them."""
    run = Path(out_dir) / UNINTERRUPTED
    shown = [summary_table(run), metrics_figure(run), resume_figure(out_dir, resume_step), *eval_figures(run),
             gallery.score_table(out_dir)]  # fmt: skip
    done = results.read_metrics(out_dir)["values"]
    shown += [dpo_table(out_dir), dpo_figure(out_dir)] if "dpo_steps" in done else []  # the run had a dpo_config
    return shown + (grpo.figures(out_dir) if "grpo_steps" in done else []) + experts.figures(run)  # a grpo_config; a MoE
