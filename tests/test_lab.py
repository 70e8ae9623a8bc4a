"""The notebooks as a person uses them: JupyterLab in headless Chromium (Playwright).

A JupyterLab (:mod:`jupyterlab`) serves a scratch copy of the notebooks on 127.0.0.1 with a token.
Each test opens a notebook, runs all cells from the Run menu and checks what the page shows: every
cell ran without an error output, widgets render as widgets and moving one changes what it shows,
and every chart with a legend keeps its size through a legend click, a zoom and a narrower window
(:func:`chromium.poke_chart`). Notebook 01 runs with its own defaults (the acceptance of issue 45:
a slider that browses the samples); the others with their ``smoke`` set. The papermill runs of the
same notebooks (``test_notebooks.py``) check their numbers; these check the page, so CI runs 01 and
03 here and the ``long`` tier the rest.
"""

from __future__ import annotations

from pathlib import Path

import chromium
import pytest
from jupyterlab import ROOT, Lab, Notebook, project_copy
from multiproc import scaled

from qwenkit.notebooks import runner

NO_BROWSER = chromium.available_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NO_BROWSER is not None, reason=str(NO_BROWSER))]

# notebook -> the parameter set injected (None: the notebook's own defaults, as a person opens it)
SETS = {"01_data_prep": None, "02_sharded_training": "smoke", "03_chunk_loss_validation": "smoke",
        "04_performance_profiling": "smoke", "05_compare_runs": "smoke"}  # fmt: skip
LONG = ("02_sharded_training", "04_performance_profiling", "05_compare_runs")


def _values(name: str) -> dict:
    if SETS[name] is None:
        return {}
    return runner.load_params(ROOT / "notebooks" / f"{name}.ipynb", SETS[name], ROOT)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    root = project_copy(tmp_path_factory.mktemp("lab") / "project", {name: _values(name) for name in SETS})
    with Lab(root) as lab, chromium.launch() as browser:
        yield lab, browser


def _ran(browser, name: str) -> Notebook:
    """``name`` opened in a fresh page and run to the end, with no error output."""
    lab, chromium_browser = browser
    page = chromium_browser.new_page(viewport=chromium.VIEWPORT)
    nb = Notebook(page, lab, name)
    prompts = nb.run_all(timeout_s=scaled(600))
    assert nb.errors() == [], f"{name}: error output: {nb.errors()}"
    assert all(p[1:-1].isdigit() for p in prompts), f"{name}: not every cell ran: {prompts}"
    return nb


def _charts_keep_their_size(nb: Notebook) -> int:
    with_legend = chromium.charts_with_legend(nb.page)
    for index in with_legend:
        chromium.assert_keeps_size(chromium.poke_chart(nb.page, index))
    return len(with_legend)


def test_01_with_its_own_defaults_browses_samples_with_a_slider(browser):
    nb = _ran(browser, "01_data_prep")
    page = nb.page
    assert nb.widgets().count() == 1, "one sample browser, drawn as a widget"
    view = page.locator(".jupyter-widgets .widget-html-content").first
    first = view.inner_html()
    assert "learned" in first or "background" in first, "the slider shows a rendered sample"
    page.locator(".jupyter-widgets .noUi-handle").first.focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function("([el, before]) => el.innerHTML !== before", arg=[view.element_handle(), first],
                           timeout=30_000)  # fmt: skip
    assert page.locator(".jupyter-widgets .widget-readout").first.inner_text().strip() == "1"
    assert len(chromium.chart_sizes(page)) >= 3 and all(h > 100 for _, h in chromium.chart_sizes(page))
    page.close()


def test_03_chunk_size_slider_redraws_and_charts_keep_their_size(browser):
    nb = _ran(browser, "03_chunk_loss_validation")
    page = nb.page
    assert nb.widgets().count() == 1, "one chunk-size slider, drawn as a widget"
    title = ".widget-output .js-plotly-plot .gtitle"  # the Output widget redraws a new chart
    assert page.locator(title).first.text_content().endswith("chunk size 7")
    page.locator(".jupyter-widgets .noUi-handle").first.focus()
    page.keyboard.press("ArrowRight")  # smoke chunk sizes 7 -> 1024
    page.wait_for_function(f"() => document.querySelector('{title}')?.textContent.endsWith('chunk size 1024')",
                           timeout=30_000)  # fmt: skip
    assert _charts_keep_their_size(nb) >= 1  # the two heads' loss curves
    page.close()


@pytest.mark.long
@pytest.mark.parametrize("name", LONG)
def test_notebook_runs_and_its_charts_keep_their_size(browser, name):
    nb = _ran(browser, name)
    assert chromium.chart_sizes(nb.page), f"{name}: no chart drawn"
    if name == "02_sharded_training":  # the live curves, redrawn in place: one chart per run, at its last step
        titles = nb.page.eval_on_selector_all(".js-plotly-plot .gtitle", "els => els.map(e => e.textContent)")
        assert "the uninterrupted run: step 8" in titles and "the resumed run: step 8" in titles, titles
    _charts_keep_their_size(nb)
    nb.page.close()


def test_lab_serves_the_copy_not_the_checkout(browser):
    lab, _ = browser
    assert Path(lab.root).resolve() != ROOT and (lab.root / "params").resolve() == ROOT / "params"
