"""How the notebooks' plotly figures are shown: :func:`setup` (once per kernel) embeds plotly.js in its own
output and makes :class:`ReportRenderer` the default: each figure then carries plotly's JSON (JupyterLab draws
it with its plotly extension) *and* an HTML div that calls the page's ``Plotly`` (nbconvert keeps it,
JupyterLab ignores it). A report rendered from the notebook therefore draws its charts offline, with no CDN
script (plotly's own ``notebook`` renderer adds a MathJax CDN tag to every figure, and its plotly.js bundle
registers as an AMD module, not ``window.Plotly``, on a page that has loaded require.js). The figures
themselves: :mod:`qwenkit.notebooks.plots`.
"""

from __future__ import annotations

import plotly.io as pio
from plotly.io import base_renderers

RENDERER = "qwenkit"
# JupyterLab's plotly renderer sizes a chart itself (to its panel, on every resize); plotly's
# `responsive` on top of it collapsed a chart to 0 px at a legend click (issue 45). A report page
# has no such renderer, so there `responsive` lets a chart follow the window's width (the height
# is the layout's in both).
LAB_CONFIG = {"displaylogo": False}
REPORT_CONFIG = {**LAB_CONFIG, "responsive": True}


class ReportRenderer(base_renderers.MimetypeRenderer):
    """plotly's JSON for JupyterLab plus an offline HTML div for nbconvert (no plotly.js in it)."""

    def to_mimebundle(self, fig_dict):
        bundle = base_renderers.PlotlyRenderer(LAB_CONFIG).to_mimebundle(dict(fig_dict))
        bundle["text/html"] = pio.to_html(
            fig_dict, config=REPORT_CONFIG, include_plotlyjs=False, include_mathjax=False, full_html=False
        )
        return bundle


def plotlyjs_html() -> str:
    """plotly.js as inline scripts that define ``window.Plotly`` even where an AMD loader exists."""
    from plotly.offline import get_plotlyjs

    return (
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};"
        "window.__qwenkitDefine = window.define; window.define = undefined;</script>\n"
        f"<script>{get_plotlyjs()}</script>\n"
        "<script>window.define = window.__qwenkitDefine;</script>"
    )


def setup() -> None:
    """Embed plotly.js once in this cell's output and make :class:`ReportRenderer` the default."""
    from IPython.display import HTML, display

    pio.renderers[RENDERER] = ReportRenderer()
    pio.renderers.default = RENDERER
    pio.templates.default = "plotly_white"
    display(HTML(plotlyjs_html()))

