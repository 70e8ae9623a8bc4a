"""The report renderer: plotly's JSON for JupyterLab, an HTML div for the report, no plotly.js and no CDN in a
figure; a report chart keeps its size in a real browser."""

import json

import chromium
import plotly.graph_objects as go
import pytest

from notebooks.test_plots import _curve_rows
from qwenkit.notebooks import plots, renderer


def test_report_renderer_bundle_has_json_for_lab_and_html_without_plotlyjs_or_cdn():
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    bundle = renderer.ReportRenderer().to_mimebundle(fig.to_dict())
    assert set(bundle) == {"application/vnd.plotly.v1+json", "text/html"}
    assert json.dumps(bundle["application/vnd.plotly.v1+json"])  # plain JSON for JupyterLab's extension
    html = bundle["text/html"]
    assert "Plotly.newPlot" in html and "<script src=" not in html and len(html) < 100_000
    js = renderer.plotlyjs_html()
    assert len(js) > 1_000_000 and "window.define = undefined" in js  # plotly.js itself, AMD hidden while it loads


def test_lab_charts_are_not_responsive_report_charts_are():
    """JupyterLab's renderer sizes charts itself; plotly's `responsive` there collapsed a chart to
    0 px at a legend click (tests/test_lab.py clicks it). A report page has only plotly.js."""
    bundle = renderer.ReportRenderer().to_mimebundle(plots.loss_curves(_curve_rows()).to_dict())
    assert "responsive" not in bundle["application/vnd.plotly.v1+json"].get("config", {})
    assert '"responsive": true' in bundle["text/html"]


NO_BROWSER = chromium.available_reason()


@pytest.mark.skipif(NO_BROWSER is not None, reason=str(NO_BROWSER))
def test_a_report_chart_keeps_its_size_on_legend_click_zoom_and_resize(tmp_path):
    """The renderer's HTML as a report holds it, in Chromium: a legend click, a zoom box and a
    narrower window leave the chart's height as it was (and it stays drawn)."""
    bundle = renderer.ReportRenderer().to_mimebundle(plots.loss_curves(_curve_rows()).to_dict())
    page = tmp_path / "report.html"
    page.write_text(f"<html><body>{renderer.plotlyjs_html()}{bundle['text/html']}</body></html>")
    sizes = {}
    report = chromium.open_page(page, check=lambda p: sizes.update(chromium.poke_chart(p, 0)))
    assert report.exceptions == [] and report.console_errors == [], (report.exceptions, report.console_errors)
    chromium.assert_keeps_size(sizes)
    assert sizes["narrower window"][0] < sizes["before"][0]  # responsive: it follows the window's width
