"""The notebooks: structure (one parameters cell, no outputs, params sets match), and every notebook
executed with its ``smoke`` set through the runner, asserting on the metrics it recorded, then its
HTML report opened in headless Chromium."""

from __future__ import annotations

import ast
import html
import json
import shutil
from pathlib import Path

import chromium
import nbformat
import plotly.io as pio
import pytest
import yaml
from multiproc import scaled

from qwenkit.engine.run import metrics
from qwenkit.notebooks import compare, gallery, grpo, perf, runner, runs, samples, trajectories, validation
from qwenkit.sweep import ledger

PLOTLY_MIME = "application/vnd.plotly.v1+json"

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = runner.list_notebooks(ROOT)
NAMES = [nb.stem for nb in NOTEBOOKS]
REQUIRED_SETS = ("smoke", "default", "gpu", "npu")


def test_the_five_notebooks_exist():
    assert NAMES == ["01_data_prep", "02_sharded_training", "03_chunk_loss_validation", "04_performance_profiling",
                     "05_compare_runs"]  # fmt: skip


def _parameters_cell(nb):
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "exactly one cell tagged 'parameters'"
    return cells[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_committed_without_outputs_on_the_standard_kernel(path):
    nb = nbformat.read(str(path), as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: a cell has outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_every_qwenkit_name_a_cell_imports_exists(path):
    """A module moved or renamed in the kit breaks the notebook that imports it; the long smoke runs (04, 05) would
    see it only under ``make test-all``, this sees it in CI: each ``from qwenkit... import name`` resolves."""
    import importlib

    missing = []
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qwenkit"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ModuleNotFoundError:
                            missing.append(f"from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("qwenkit"):
                        importlib.import_module(alias.name)
    assert not missing, missing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_parameters_cell_is_flat_commented_scalars(path):
    cell = _parameters_cell(nbformat.read(str(path), as_version=4))
    lines = [line for line in cell.source.splitlines() if line.strip()]
    names = []
    for line in lines:
        stmt = ast.parse(line).body
        assert len(stmt) == 1 and isinstance(stmt[0], ast.Assign), f"{path.name}: not one assignment: {line!r}"
        assert isinstance(stmt[0].value, ast.Constant), f"{path.name}: not a literal (derived?): {line!r}"
        assert isinstance(stmt[0].value.value, (bool, int, float, str)), f"{path.name}: not a scalar: {line!r}"
        assert "  # " in line, f"{path.name}: parameter without a comment: {line!r}"
        names.append(stmt[0].targets[0].id)
    # papermill reads every one of them (a '=' in a comment made it skip lines before)
    assert list(runner.notebook_parameters(path)) == names
    assert runner.OUTPUT_PARAM in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_every_params_key_is_a_parameter(path):
    known = runner.notebook_parameters(path)
    folder = ROOT / "params" / path.stem
    sets = {p.stem for p in folder.glob("*.yaml")}
    assert set(REQUIRED_SETS) <= sets, f"{folder} lacks {set(REQUIRED_SETS) - sets}"
    for yml in sorted(folder.glob("*.yaml")):
        values = yaml.safe_load(yml.read_text()) or {}
        assert set(values) <= set(known), f"{yml}: {set(values) - set(known)} are not parameters"
        for key, value in values.items():
            default = ast.literal_eval(known[key]["default"])
            assert type(value) is type(default) or {type(value), type(default)} == {int, float}, (
                f"{yml}: {key}={value!r} is a {type(value).__name__}, the notebook's default a {type(default).__name__}"
            )
        runner.load_params(path, yml.stem, ROOT)  # the runner's own check agrees


def test_runner_rejects_unknown_keys_and_sets(tmp_path):
    root = tmp_path / "proj"
    (root / "notebooks").mkdir(parents=True)
    (root / "params" / "03_chunk_loss_validation").mkdir(parents=True)
    (root / "qwenkit").mkdir()
    nb = root / "notebooks" / "03_chunk_loss_validation.ipynb"
    nb.write_text((ROOT / "notebooks" / nb.name).read_text())
    (root / "params" / "03_chunk_loss_validation" / "typo.yaml").write_text("chunk_size: 64\n")
    (root / "params" / "03_chunk_loss_validation" / "out.yaml").write_text("output_dir: x\n")
    with pytest.raises(ValueError, match="'chunk_size' not in the parameters cell"):
        runner.load_params(nb, "typo", root)
    with pytest.raises(ValueError, match="set by the runner"):
        runner.load_params(nb, "out", root)
    with pytest.raises(FileNotFoundError, match="no parameter set 'nope'.*available: out, typo"):
        runner.load_params(nb, "nope", root)


# ---------------------------------------------------------------------------------------------
# Executing every notebook with its smoke set


# Notebooks 04 and 05 run in the `long` tier (`make test-all`, not CI): their figures and numbers
# come from the benchmark harness and the sweep, whose own tests (test_perf, test_sweep) CI runs.
LONG_NOTEBOOKS = ("04_performance_profiling", "05_compare_runs")


def _tier(name: str):
    return pytest.param(name, marks=pytest.mark.long) if name in LONG_NOTEBOOKS else name


def _run_smoke(tmp_path_factory, names) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("reports")
    # a hung cell fails its notebook instead of the whole run (no smoke cell takes a minute)
    run_dir, outcomes = runner.run("smoke", only=list(names), out=out, run_name="smoke", root=ROOT,
                                   cell_timeout=int(scaled(600)))  # fmt: skip
    return run_dir, {o.notebook: o for o in outcomes}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One runner call for notebooks 01-03 (the expensive part: about two minutes on 2 cores)."""
    return _run_smoke(tmp_path_factory, [n for n in NAMES if n not in LONG_NOTEBOOKS])


@pytest.fixture(scope="module")
def smoke_run_long(tmp_path_factory):
    return _run_smoke(tmp_path_factory, LONG_NOTEBOOKS)


def _smoke(request, name: str):
    return request.getfixturevalue("smoke_run_long" if name in LONG_NOTEBOOKS else "smoke_run")


def _metrics(smoke_run, name):
    run_dir, outcomes = smoke_run
    o = outcomes[name]
    assert o.error is None, f"{name} failed: {o.error} (see {o.html})"
    return json.loads((run_dir / name / "metrics.json").read_text())


@pytest.mark.slow
def test_smoke_01_data_prep(smoke_run):
    m = _metrics(smoke_run, "01_data_prep")
    v = m["values"]
    assert m["passed"] and v["good"] == 16 and v["bad"] == 0
    assert v["image_tokens_total"] == 16 * 16  # one 112 px image = 16 tokens per sample
    assert 0 < v["learned_tokens_total"] < v["tokens"]["max"] * 16
    padded, packed = v["padding_fraction"].values()  # micro-batch 4: padded vs data.packing
    assert 0 < padded < 1 and packed == 0
    page = (smoke_run[0] / "01_data_prep.html").read_text()
    assert "learned" in page and "data:image/png;base64," in page  # rendered samples with their images


@pytest.mark.slow
def test_smoke_02_sharded_training(smoke_run):
    m = _metrics(smoke_run, "02_sharded_training")
    v = m["values"]
    assert v["ranks"] == 2 and v["steps"] == 8
    assert v["loss_decreased"] and v["last_loss"] < v["first_loss"]
    assert v["resumed_from"] == 4 and v["resumed_steps"] == 4  # a new run from the uninterrupted run's step 4
    assert v["resume_matches"] and v["resume_max_abs_diff"] <= 1e-6  # DCP resume is bit-identical on gloo
    assert m["passed"]
    # did it learn: held-out loss at step 0, every eval_every and the end; accuracy at step 0 and the end
    assert v["eval_loss_steps"] == [0, 4, 8] and v["eval_accuracy_steps"] == [0, 8]
    assert v["first_eval_loss"] > 0 and v["last_eval_loss"] > 0
    assert 0 <= v["first_eval_accuracy"] <= 1 and 0 <= v["last_eval_accuracy"] <= 1
    assert f"held-out accuracy {v['first_eval_accuracy']:.2f} -> {v['last_eval_accuracy']:.2f}" in m["summary"]
    folder = smoke_run[0] / "02_sharded_training"
    pairs = [json.loads(line) for line in (folder / gallery.EVAL_SAMPLES).read_text().splitlines()]
    assert len(pairs) == 2 and {(p["untrained_step"], p["trained_step"]) for p in pairs} == {(0, 8)}
    page = (smoke_run[0] / "02_sharded_training.html").read_text()
    assert 'class="eval-gallery"' in page and page.count("data:image/png;base64,") >= 2  # one thumbnail per row
    assert "held-out accuracy" in (smoke_run[0] / "index.html").read_text()


@pytest.mark.slow
def test_smoke_02_dpo_from_the_sft_run(smoke_run):
    """The smoke set's DPO branch: 2 steps from the uninterrupted run's last checkpoint, its
    held-out preference metrics at step 0 (the SFT start: margin 0) and the end, in the summary."""
    v = _metrics(smoke_run, "02_sharded_training")["values"]
    folder = smoke_run[0] / "02_sharded_training"
    started = metrics.read(folder / runs.DPO)
    assert v["dpo_steps"] == 2 and v["dpo_eval_steps"] == [0, 2] and v["dpo_sft_step"] == 8
    # the start is the uninterrupted run's step-8 checkpoint, exported once into its folder
    assert (folder / runs.UNINTERRUPTED / "hf-step-00000008" / "config.json").is_file()
    margins, accuracies = (metrics.series(started, f"eval_rewards/{m}") for m in ("margins", "accuracies"))
    assert margins[0] == 0 and accuracies[0] == 0  # at step 0 the policy is the reference
    assert v["dpo_first_logps_accuracies"] == metrics.series(started, "eval_logps/accuracies")[0]
    assert v["dpo_started_at_reference"] and v["dpo_last_rewards_margins"] == margins[2]
    assert v["dpo_margin_grew"] == (margins[2] > 0)  # recorded; 2 steps from 8 need not move held-out pairs
    sft_eval = metrics.series(metrics.read(folder / runs.UNINTERRUPTED), "eval_loss")
    assert v["dpo_sft_eval_loss"] == sft_eval[8]
    index = (smoke_run[0] / "index.html").read_text()
    assert html.escape(f"held-out preference accuracy {v['dpo_first_logps_accuracies']:.2f} -> ") in index
    page = (smoke_run[0] / "02_sharded_training.html").read_text()
    assert "held-out preference accuracy" in page and page.count('class="run-log"') == 4


@pytest.mark.slow
def test_smoke_02_grpo_from_the_sft_run(smoke_run):
    """The smoke set's GRPO branch: 3 steps from the uninterrupted run's last checkpoint; its reward
    curve and the completions of a prompt rank 0 rolled out at two steps, in the report."""
    v = _metrics(smoke_run, "02_sharded_training")["values"]
    folder = smoke_run[0] / "02_sharded_training"
    rows = metrics.read(folder / grpo.GRPO)
    assert v["grpo_steps"] == 3 and v["grpo_rewards"] == list(grpo.reward_weights(folder / grpo.GRPO))  # the config's
    assert v["grpo_first_reward"] == metrics.series(rows, "reward")[1] and v["grpo_first_kl"] == 0  # policy = reference
    changed = [json.loads(line) for line in (folder / grpo.CHANGED).read_text().splitlines()]
    assert len(changed) == v["grpo_changed_prompts"] >= 1  # 2 prompts a step, rank 0 draws one: 3 steps repeat one
    assert all(r["early"]["x"] < r["late"]["x"] and len(r["late"]["completions"]) == 2 for r in changed)
    page = (smoke_run[0] / "02_sharded_training.html").read_text()
    assert "GRPO: the rollouts' reward over the steps" in page and "frac_reward_zero_std" in page
    table = page[page.index('class="grpo-completions"'):]
    table = table[: table.index("</table>")]
    first = changed[0]
    assert html.escape(first["reference"]) in table and f"{first['x_name']} {first['late']['x']}" in table
    assert f"GRPO 3 steps: mean reward {v['grpo_first_reward']:.2f} (first 1 steps)" in (smoke_run[0] / "index.html").read_text()
    assert trajectories.NONE in page  # the trajectory view's line for a run without tools (tests/notebooks/test_trajectories.py)


@pytest.mark.slow
def test_smoke_03_chunk_loss_validation(smoke_run):
    m = _metrics(smoke_run, "03_chunk_loss_validation")
    v = m["values"]
    assert v["cases"] == 2 * 2 * 2 and v["cases_passed"] == v["cases"]  # chunk sizes x loss types x modalities
    assert v["max_grad_abs_diff"] <= 1e-6 and v["max_loss_abs_diff"] <= 1e-5
    assert v["curve_max_abs_diff"] <= v["curve_tolerance"] == 1e-5
    assert v["loss_decreased"]
    assert m["passed"]
    folder = smoke_run[0] / "03_chunk_loss_validation"
    assert {"chunk_vs_full.csv", "adamw_curves.csv", "metrics.json"} <= {p.name for p in folder.iterdir()}


@pytest.mark.slow
@pytest.mark.long
def test_smoke_04_performance_profiling(smoke_run_long):
    m = _metrics(smoke_run_long, "04_performance_profiling")
    v = m["values"]
    assert v["head"]["peak_ratio"] < 0.8  # the chunked head's memory is well below the full head's
    assert v["recommended_chunk"] in (32, 128, 512)
    assert 0 < v["mfu"] < 1 and v["flops_per_step"] > 0
    assert v["fused_available"] is False  # CPU: nothing to fuse
    assert v["fused_ops"]["swiglu"].startswith("patched") and v["fused_ops"]["text_mrope"].startswith("original")
    assert m["passed"]


@pytest.mark.slow
@pytest.mark.long
def test_smoke_05_compare_runs(smoke_run_long):
    m = _metrics(smoke_run_long, "05_compare_runs")
    v = m["values"]
    assert v["runs"] == v["done"] == 3 and v["varied"] == ["train.lr", "train.seed"]
    folder = smoke_run_long[0] / "05_compare_runs"
    finals = {name: metrics.final_metrics(folder / "sweep" / name) for name in v["ranking"]}
    losses = [finals[name]["eval_loss"] for name in v["ranking"]]
    assert losses == sorted(losses) and v["best"] == v["ranking"][0]  # rank_by eval_loss: lowest first
    assert v["eval_loss"] == {name: f["eval_loss"] for name, f in finals.items()}
    assert all(f["steps"] == 4 and f["trainable_params"] > 0 for f in finals.values())
    rows = ledger.latest(folder / "sweep")
    assert [r["status"] for r in rows.values()] == ["done"] * 3
    page = (smoke_run_long[0] / "05_compare_runs.html").read_text()
    # the report: figures first, each trial's log collapsed at the end
    assert page.count('class="run-log"') == 3 and page.index('class="plotly-graph-div"') < page.index('class="run-log"')
    assert m["passed"]


@pytest.mark.slow
def test_report_02_collapses_the_run_logs_below_the_summary(smoke_run):
    page = (smoke_run[0] / "02_sharded_training.html").read_text()
    assert page.count('class="run-log"') == 4  # the uninterrupted, the resumed, the DPO and the GRPO run
    first_log = page.index('class="run-log"')
    assert page.index('class="plotly-graph-div"') < first_log  # the summary table comes before the log
    assert page.count("step 1/8") == 1 and "more lines" in page  # inside the block: first and last lines


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["smoke_run", pytest.param("smoke_run_long", marks=pytest.mark.long)])
def test_index_links_every_report_with_its_summary(request, fixture):
    run_dir, outcomes = request.getfixturevalue(fixture)
    index = (run_dir / "index.html").read_text()
    for name, o in outcomes.items():
        assert f'href="{name}.html"' in index and (run_dir / f"{name}.html").is_file()
        assert o.summary and html.escape(o.summary.split(";")[0]) in index
        assert o.status == "passed", f"{name}: {o.status}: {o.summary}"
    assert (run_dir.parent / "latest").resolve() == run_dir.resolve()


@pytest.mark.slow
@pytest.mark.parametrize("name", [_tier(n) for n in NAMES])
def test_reports_are_standalone_with_code_hidden(request, name):
    run_dir, _ = _smoke(request, name)
    page = (run_dir / f"{name}.html").read_text()
    assert "cdnjs.cloudflare.com" not in page and "unpkg.com" not in page, f"{name}: a CDN script"
    assert "kernel.setup()" not in page, f"{name}: code is shown"
    assert page.count('class="plotly-graph-div"') >= 2, f"{name}: plotly figures missing"


# ---------------------------------------------------------------------------------------------
# The reports in a browser

NO_BROWSER = chromium.available_reason()


@pytest.mark.slow
@pytest.mark.skipif(NO_BROWSER is not None, reason=str(NO_BROWSER))
@pytest.mark.parametrize("name", [_tier(n) for n in ("02_sharded_training", "03_chunk_loss_validation", "05_compare_runs")])
def test_report_charts_draw_in_chromium_without_errors(request, name):
    """Every chart draws, offline, and the first with a legend keeps its size through a legend
    click, a zoom and a narrower window (as in JupyterLab: tests/test_lab.py)."""
    poked = []

    def poke_first_legend(page):
        poked.extend(chromium.poke_chart(page, i) for i in chromium.charts_with_legend(page)[:1])

    page = chromium.open_page(_smoke(request, name)[0] / f"{name}.html", check=poke_first_legend)
    assert page.exceptions == [] and page.console_errors == [], (page.exceptions, page.console_errors)
    assert page.external_requests == [], "a standalone report must not fetch anything"
    assert len(page.charts) >= 3
    for chart in page.charts:
        assert chart["svg"] >= 1 and chart["traces"] >= 1, f"a plotly chart did not draw: {page.charts}"
    assert len(poked) == 1, f"{name}: no chart with a legend"
    chromium.assert_keeps_size(poked[0])


@pytest.mark.skipif(NO_BROWSER is not None, reason=str(NO_BROWSER))
def test_browser_check_sees_a_broken_chart(tmp_path):
    """The browser check can fail: a chart whose plotly.js is missing, and a script error."""
    page = tmp_path / "broken.html"
    page.write_text(
        '<html><body><div class="plotly-graph-div" id="a"></div>'
        "<script>Plotly.newPlot('a', [{y: [1, 2]}]);</script></body></html>"
    )
    report = chromium.open_page(page)
    assert report.charts == [{"svg": 0, "traces": 0, "plotly": False}]
    assert any("Plotly is not defined" in e for e in report.exceptions)


@pytest.mark.slow
def test_interactive_true_adds_widget_controls(tmp_path):
    """What JupyterLab gets with interactive = True: a live ipywidgets control, not a static figure."""
    import papermill

    nb = ROOT / "notebooks" / "01_data_prep.ipynb"
    out = tmp_path / "01.ipynb"
    papermill.execute_notebook(
        str(nb), str(out), kernel_name="python3", cwd=str(nb.parent), progress_bar=False,
        parameters={"tiny_samples": 4, "interactive": True, "output_dir": str(tmp_path / "res")},
        execution_timeout=int(scaled(300)),  # a hung cell fails the test instead of the whole run
    )  # fmt: skip
    outputs = [o for c in nbformat.read(str(out), as_version=4).cells if c.cell_type == "code" for o in c.outputs]
    views = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1, "one sample browser"


# ---------------------------------------------------------------------------------------------
# Every figure comes from the result files


def _redrawn(name: str, folder: Path) -> list:
    if name == "02_sharded_training":
        resume_step = json.loads((folder / "metrics.json").read_text())["values"]["resumed_from"]
        return runs.figures(folder, resume_step)
    module = {"01_data_prep": samples, "03_chunk_loss_validation": validation, "04_performance_profiling": perf,
              "05_compare_runs": compare}[name]  # fmt: skip
    return module.figures(folder)


@pytest.mark.slow
@pytest.mark.parametrize("name", [_tier(n) for n in NAMES])
def test_figures_redraw_from_the_result_files_alone(request, name, tmp_path):
    """Copy only the CSV/JSON/JSONL a notebook wrote, re-draw its figures from them, and compare
    every trace with what the executed notebook showed."""
    run_dir, _ = _smoke(request, name)
    for path in (run_dir / name).rglob("*"):
        if path.suffix in (".csv", ".json", ".jsonl"):
            copy = tmp_path / path.relative_to(run_dir / name)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)
    shown = [
        o["data"][PLOTLY_MIME]["data"]
        for c in nbformat.read(str(run_dir / f"{name}.ipynb"), as_version=4).cells if c.cell_type == "code"
        for o in c.outputs if PLOTLY_MIME in o.get("data", {})
    ]  # fmt: skip
    redrawn = [json.loads(pio.to_json(f))["data"] for f in _redrawn(name, tmp_path)]
    assert len(redrawn) == len(shown) >= 3, f"{name}: {len(redrawn)} figures re-drawn, {len(shown)} shown"
    for i, (again, seen) in enumerate(zip(redrawn, shown)):
        assert again == seen, f"{name}: figure {i + 1} differs when drawn from the result files"
