"""``qwenkit notebooks run``: execute the notebooks with papermill and render shareable HTML reports.

For each selected notebook ``notebooks/NN_name.ipynb`` and parameter set ``params/NN_name/SET.yaml``:

1. the YAML's keys are checked against the notebook's ``parameters`` cell (a typo fails before
   any kernel starts);
2. papermill runs the notebook under the standard ``python3`` kernel into
   ``reports/<run>/NN_name.ipynb``, with ``output_dir = reports/<run>/NN_name/`` injected (the
   notebook writes its CSV/JSONL results and ``metrics.json`` there) and :data:`BATCH_VALUES`
   (``interactive = False``: the notebook's own defaults are for a person in JupyterLab);
3. nbconvert renders ``reports/<run>/NN_name.html``: code hidden, a run-info header added,
   no CDN script (plotly.js is embedded by :func:`qwenkit.notebooks.renderer.setup`), so it works offline;
4. ``reports/<run>/index.html`` links every report with the one-line summary from its
   ``metrics.json``, and ``reports/latest`` points at the run.

A notebook that fails is still rendered (papermill keeps the outputs up to the error) and marked
failed in the index; the command then exits 1.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import qwenkit
from qwenkit.notebooks import pages, progress, results
from qwenkit.notebooks.kernel import project_root

log = logging.getLogger(__name__)

KERNEL = "python3"
OUTPUT_PARAM = "output_dir"  # every notebook has it; the runner sets it
# A notebook's defaults are a person's in JupyterLab; a batch run (papermill, a report) overrides
# these wherever the notebook has them: no live widgets, which a rendered page could not drive.
BATCH_VALUES: dict[str, Any] = {"interactive": False}


# ---------------------------------------------------------------------------------------------
# Notebooks and parameter sets


def list_notebooks(root: Path | None = None) -> list[Path]:
    root = root or project_root()
    return sorted(p for p in (root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def select(notebooks: list[Path], only: list[str] | None) -> list[Path]:
    """``only`` entries match a number (``3``, ``03``), a name (``chunk_loss_validation``) or a stem."""
    if not only:
        return notebooks
    chosen = []
    for want in only:
        want = Path(want).stem
        hits = [
            nb for nb in notebooks
            if want in (nb.stem, nb.stem[:2], nb.stem[3:]) or (want.isdigit() and int(want) == int(nb.stem[:2]))
        ]  # fmt: skip
        if not hits:
            names = ", ".join(nb.stem for nb in notebooks)
            raise ValueError(f"--only {want!r} matches no notebook; known: {names}")
        chosen.extend(h for h in hits if h not in chosen)
    return sorted(chosen)


def notebook_parameters(path: Path) -> dict[str, dict[str, Any]]:
    """The names, inferred types, defaults and comments of a notebook's ``parameters`` cell."""
    import papermill

    return papermill.inspect_notebook(str(path))


def load_params(notebook: Path, name: str, root: Path | None = None) -> dict[str, Any]:
    """``params/<notebook stem>/<name>.yaml``, checked against the notebook's parameters."""
    root = root or project_root()
    path = root / "params" / notebook.stem / f"{name}.yaml"
    if not path.is_file():
        sets = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise FileNotFoundError(f"{path}: no parameter set {name!r} for {notebook.stem}; available: {', '.join(sets)}")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: must be a mapping of parameter names to values")
    known = notebook_parameters(notebook)
    unknown = [k for k in values if k not in known]
    if unknown:
        raise ValueError(f"{path}: {', '.join(map(repr, unknown))} not in the parameters cell of {notebook.name}; "
                         f"known: {', '.join(known)}")  # fmt: skip
    if OUTPUT_PARAM in values:
        raise ValueError(f"{path}: {OUTPUT_PARAM!r} is set by the runner (reports/<run>/<notebook>/), leave it out")
    batch = [k for k in values if k in BATCH_VALUES]
    if batch:
        raise ValueError(f"{path}: {', '.join(map(repr, batch))} is set by the runner for every batch run "
                         f"({', '.join(f'{k}={v!r}' for k, v in BATCH_VALUES.items())}), leave it out")  # fmt: skip
    return values


def batch_parameters(notebook: Path, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with :data:`BATCH_VALUES` for the parameters ``notebook`` has."""
    known = notebook_parameters(notebook)
    return {**values, **{k: v for k, v in BATCH_VALUES.items() if k in known}}


# ---------------------------------------------------------------------------------------------
# Executing and rendering


@dataclass
class Outcome:
    notebook: str
    params: str
    html: Path
    seconds: float
    error: str | None = None  # the exception if the notebook did not run to the end
    metrics: dict[str, Any] | None = None
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        if self.error:
            return "error"
        if self.metrics is None:
            return "no metrics"
        return "passed" if self.metrics.get("passed") else "checks failed"

    @property
    def summary(self) -> str:
        if self.metrics is not None:
            return self.metrics.get("summary", "")
        return self.error or "the notebook wrote no metrics.json"


def execute(notebook: Path, out_dir: Path, params_name: str, values: dict[str, Any],
            cell_timeout: int | None = None) -> Outcome:  # fmt: skip
    """Run one notebook into ``out_dir`` and render its HTML; never raises for a failing notebook
    (nor for a cell that runs past ``cell_timeout`` seconds: that is its error)."""
    import papermill

    stem = notebook.stem
    results_dir = out_dir / stem
    results_dir.mkdir(parents=True, exist_ok=True)
    parameters = {**batch_parameters(notebook, values), OUTPUT_PARAM: str(results_dir)}
    out_nb = out_dir / f"{stem}.ipynb"
    t0 = time.perf_counter()
    error = None
    before = os.environ.get(progress.REPORT_ENV)
    os.environ[progress.REPORT_ENV] = "1"  # the kernel inherits it: a report, no live progress bars
    try:
        papermill.execute_notebook(
            str(notebook), str(out_nb), parameters=parameters, kernel_name=KERNEL,
            cwd=str(notebook.parent), progress_bar=False, log_output=False, execution_timeout=cell_timeout,
        )  # fmt: skip
    except Exception as e:  # papermill's error carries the failing cell's exception
        error = _one_line(e)
    finally:
        if before is None:
            os.environ.pop(progress.REPORT_ENV)
        else:
            os.environ[progress.REPORT_ENV] = before
    seconds = time.perf_counter() - t0
    outcome = Outcome(stem, params_name, out_dir / f"{stem}.html", seconds, error, results.read_metrics(results_dir), parameters)
    if out_nb.is_file():
        render_html(out_nb, outcome)
    return outcome


def _one_line(e: Exception) -> str:
    ename = getattr(e, "ename", type(e).__name__)
    evalue = getattr(e, "evalue", str(e))
    text = f"{ename}: {evalue}".strip()
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # ANSI colours from tracebacks
    return text.splitlines()[0][:300] if text else ename


def render_html(executed: Path, outcome: Outcome) -> Path:
    """Standalone HTML of an executed notebook: code hidden, a run-info header, no CDN scripts."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(executed), as_version=4)
    nb.cells.insert(1 if nb.cells and nb.cells[0].cell_type == "markdown" else 0, _run_info_cell(outcome))
    exporter = HTMLExporter(
        template_name="lab",
        extra_loaders=[jinja2.DictLoader({"qwenkit_report.html.j2": pages.REPORT_TEMPLATE})],
        template_file="qwenkit_report.html.j2",
        exclude_input=True,
        exclude_input_prompt=True,
        exclude_output_prompt=True,
    )
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": outcome.notebook}})
    outcome.html.write_text(body)
    return outcome.html


def _run_info_cell(outcome: Outcome):
    import nbformat

    shown = {k: v for k, v in outcome.values.items() if k != OUTPUT_PARAM}
    params = ", ".join(f"`{k}={v!r}`" for k, v in shown.items()) or "the notebook's defaults"
    lines = [
        f"**Report** of `{outcome.notebook}` with parameter set **{outcome.params}** "
        f"({datetime.datetime.now():%Y-%m-%d %H:%M}, {outcome.seconds:.0f} s, status: {outcome.status}).",
        "",
        f"Parameters: {params}.",
        "",
        f"Result files: `{outcome.notebook}/` beside this report.",
    ]
    if outcome.error:
        lines += ["", f"**The notebook stopped with an error:** `{outcome.error}`"]
    return nbformat.v4.new_markdown_cell("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Index


def write_index(out_dir: Path, outcomes: list[Outcome], run_name: str, params_name: str) -> Path:
    import platform

    import torch

    rows = [
        pages.index_row(o.notebook, o.html.name, o.status, o.summary, o.seconds,
                        [p.name for p in sorted((out_dir / o.notebook).glob("*")) if p.is_file()])
        for o in outcomes
    ]  # fmt: skip
    total = sum(o.seconds for o in outcomes)
    meta = (
        f"parameter set {params_name}; {len(outcomes)} notebooks in {total:.0f} s; "
        f"written {datetime.datetime.now():%Y-%m-%d %H:%M}; qwenkit {qwenkit.__version__}, torch {torch.__version__}, "
        f"Python {platform.python_version()} on {platform.node()}"
    )
    path = out_dir / "index.html"
    path.write_text(pages.index_page(run_name, meta, rows))
    return path


# ---------------------------------------------------------------------------------------------
# The command


def run(
    params: str = "default",
    only: list[str] | None = None,
    out: str | Path = "reports",
    run_name: str | None = None,
    root: Path | None = None,
    cell_timeout: int | None = None,
) -> tuple[Path, list[Outcome]]:
    """Run the selected notebooks with one parameter set; returns the run folder and outcomes.
    ``cell_timeout``: seconds a cell may run before its notebook fails (None: no limit)."""
    if cell_timeout is not None and (not isinstance(cell_timeout, int) or cell_timeout <= 0):
        # papermill's client (nbclient) takes whole seconds only
        raise ValueError(f"--cell-timeout must be a whole number of seconds > 0, got {cell_timeout!r}")
    root = root or project_root()
    chosen = select(list_notebooks(root), only)
    if not chosen:
        raise FileNotFoundError(f"no notebooks in {root / 'notebooks'}")
    values = {nb: load_params(nb, params, root) for nb in chosen}  # every set checked before any run
    run_name = run_name or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_root = Path(out) if Path(out).is_absolute() else Path.cwd() / out
    out_dir = out_root / run_name
    out_dir.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for nb in chosen:
        print(f"[{nb.stem}] running with params/{nb.stem}/{params}.yaml ...", flush=True)
        o = execute(nb, out_dir, params, values[nb], cell_timeout)
        print(f"[{nb.stem}] {o.status} in {o.seconds:.0f} s: {o.summary}", flush=True)
        outcomes.append(o)
        write_index(out_dir, outcomes, run_name, params)  # a partial index is there if a later one hangs
    _point_latest(out_root, run_name)
    return out_dir, outcomes


def _point_latest(out_root: Path, run_name: str) -> None:
    latest = out_root / "latest"
    try:
        if latest.is_symlink():
            latest.unlink()
        if not latest.exists():
            os.symlink(run_name, latest)
    except OSError as e:  # e.g. a file system without symlinks; the run folder is what matters
        log.warning("could not point %s at %s: %s", latest, run_name, e)
