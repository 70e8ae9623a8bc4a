"""``qwenkit notebooks run``: execute the notebooks with papermill and render shareable HTML reports.

For each selected notebook ``notebooks/NN_name.ipynb`` and parameter set ``params/NN_name/SET.yaml``:

1. the YAML's keys are checked against the notebook's ``parameters`` cell (a typo fails before
   any kernel starts);
2. papermill runs the notebook under the standard ``python3`` kernel into
   ``reports/<run>/NN_name.ipynb``, with ``output_dir = reports/<run>/NN_name/`` injected: the
   notebook writes its CSV/JSONL results and ``metrics.json`` there;
3. nbconvert renders ``reports/<run>/NN_name.html``: code hidden, a run-info header added,
   no CDN script (plotly.js is embedded by :func:`qwenkit.plots.setup`), so it works offline;
4. ``reports/<run>/index.html`` links every report with the one-line summary from its
   ``metrics.json``, and ``reports/latest`` points at the run.

A notebook that fails is still rendered (papermill keeps the outputs up to the error) and marked
failed in the index; the command then exits 1.
"""

from __future__ import annotations

import datetime
import html
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

import qwenkit
from qwenkit import results

log = logging.getLogger(__name__)

KERNEL = "python3"
OUTPUT_PARAM = "output_dir"  # every notebook has it; the runner sets it
# lab template without its CDN scripts (require.js, MathJax, Mermaid, widget manager): the
# reports need none of them, and a report must open offline without network errors.
REPORT_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
"""


# ---------------------------------------------------------------------------------------------
# Where things are


def project_root(start: str | Path | None = None) -> Path:
    """The checkout holding ``notebooks/`` and ``params/``: above ``start`` (default: cwd), else the package's."""
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "notebooks").is_dir() and (d / "params").is_dir() and (d / "qwenkit").is_dir():
            return d
    src = Path(__file__).resolve().parent.parent
    if (src / "notebooks").is_dir():
        return src
    raise FileNotFoundError(f"no qwenkit checkout (notebooks/ and params/) at or above {here}")


def project_path(path: str | Path) -> Path:
    """``path`` as given if absolute, else relative to the project root (not to the notebook's folder).

    JupyterLab runs a notebook in ``notebooks/``, papermill wherever it is told; parameters such as
    ``data_path: tiny_data/x.json`` mean the same file in both.
    """
    p = Path(path).expanduser()
    return p if p.is_absolute() else (project_root() / p).resolve()


PATH_KEYS = ("model.path", "data.path", "data.image_dir", "train.output_dir")


def load_config(overrides: dict[str, Any], path: str | None = None):
    """A validated :class:`qwenkit.config.Config` from a notebook's parameters.

    ``overrides`` are dotted keys (``{"data.path": data_path}``); path values other than
    ``tiny`` are resolved with :func:`project_path`, so the notebook and papermill agree.
    """
    from qwenkit import config as qconfig

    resolved = {
        k: str(project_path(v)) if k in PATH_KEYS and isinstance(v, str) and v not in ("tiny", "") else v
        for k, v in overrides.items()
    }
    return qconfig.load(str(project_path(path)) if path else None, resolved)


def output_folder(output_dir: str) -> Path:
    """The notebook's results folder (created), resolved like every other path parameter."""
    out = project_path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def int_list(text: str) -> list[int]:
    """``"64, 256,1024"`` -> ``[64, 256, 1024]``: list parameters stay flat strings in the parameters cell."""
    try:
        return [int(x) for x in str_list(text)]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


def str_list(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def setup() -> None:
    """First call of every notebook: plotly renderer and plotly.js, quiet transformers, INFO logs."""
    from qwenkit import plots

    plots.setup()
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stdout, force=True)


def show_results(out_dir: str | Path) -> None:
    """Print a notebook's summary, whether its checks passed, and the result files it wrote."""
    out = Path(out_dir)
    doc = results.read_metrics(out)
    if doc is None:
        print(f"no {results.METRICS_FILE} in {out}")
        return
    print(f"{'PASSED' if doc['passed'] else 'CHECKS FAILED'}: {doc['summary']}")
    print(f"result files in {out}:")
    for p in sorted(out.iterdir()):
        if p.is_file():
            print(f"  {p.name:<28} {p.stat().st_size:>10,} bytes")


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
    return values


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


def execute(notebook: Path, out_dir: Path, params_name: str, values: dict[str, Any]) -> Outcome:
    """Run one notebook into ``out_dir`` and render its HTML; never raises for a failing notebook."""
    import papermill

    stem = notebook.stem
    results_dir = out_dir / stem
    results_dir.mkdir(parents=True, exist_ok=True)
    parameters = {**values, OUTPUT_PARAM: str(results_dir)}
    out_nb = out_dir / f"{stem}.ipynb"
    t0 = time.perf_counter()
    error = None
    try:
        papermill.execute_notebook(
            str(notebook), str(out_nb), parameters=parameters, kernel_name=KERNEL,
            cwd=str(notebook.parent), progress_bar=False, log_output=False,
        )  # fmt: skip
    except Exception as e:  # papermill's error carries the failing cell's exception
        error = _one_line(e)
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
        extra_loaders=[jinja2.DictLoader({"qwenkit_report.html.j2": REPORT_TEMPLATE})],
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

    rows = []
    for o in outcomes:
        colour = {"passed": "#1a7f37", "checks failed": "#b35900"}.get(o.status, "#c62828")
        files = ", ".join(
            f'<a href="{html.escape(o.notebook)}/{html.escape(p.name)}">{html.escape(p.name)}</a>'
            for p in sorted((out_dir / o.notebook).glob("*")) if p.is_file()
        )  # fmt: skip
        rows.append(
            f'<tr><td><a href="{html.escape(o.html.name)}">{html.escape(o.notebook)}</a></td>'
            f'<td style="color:{colour};font-weight:600">{o.status}</td>'
            f"<td>{html.escape(o.summary)}</td><td>{o.seconds:.0f} s</td><td class=files>{files}</td></tr>"
        )
    total = sum(o.seconds for o in outcomes)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>qwenkit reports: {html.escape(run_name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem; color: #222; }}
table {{ border-collapse: collapse; width: 100%; }}
td, th {{ border-bottom: 1px solid #ddd; padding: .5rem .7rem; text-align: left; vertical-align: top; }}
th {{ background: #f5f5f5; }} .files {{ font-size: .85em; }} .meta {{ color: #666; }}
</style></head><body>
<h1>qwenkit reports: {html.escape(run_name)}</h1>
<p class="meta">parameter set <b>{html.escape(params_name)}</b>; {len(outcomes)} notebooks in {total:.0f} s;
written {datetime.datetime.now():%Y-%m-%d %H:%M}; qwenkit {qwenkit.__version__}, torch {torch.__version__},
Python {platform.python_version()} on {html.escape(platform.node())}</p>
<table><tr><th>notebook</th><th>status</th><th>summary</th><th>time</th><th>result files</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
    path = out_dir / "index.html"
    path.write_text(page)
    return path


# ---------------------------------------------------------------------------------------------
# The command


def run(
    params: str = "default",
    only: list[str] | None = None,
    out: str | Path = "reports",
    run_name: str | None = None,
    root: Path | None = None,
) -> tuple[Path, list[Outcome]]:
    """Run the selected notebooks with one parameter set; returns the run folder and outcomes."""
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
        o = execute(nb, out_dir, params, values[nb])
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


def run_main(args) -> int:
    try:
        out_dir, outcomes = run(args.params, args.only, args.out, args.run_name)
    except (FileNotFoundError, ValueError) as e:
        print(f"qwenkit notebooks run: {e}", file=sys.stderr)
        return 2
    print(f"index: {out_dir / 'index.html'}")
    return 0 if all(o.status == "passed" for o in outcomes) else 1
