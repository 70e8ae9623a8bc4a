"""The HTML around the reports: the nbconvert template and the run's ``index.html``.

Kept apart from :mod:`qwenkit.notebooks.runner`, which decides what runs and in which order;
this module only turns its outcomes into markup. Nothing here loads a script from a CDN: a
report folder must open offline.
"""

from __future__ import annotations

import html

# lab template without its CDN scripts (require.js, MathJax, Mermaid, widget manager): the
# reports need none of them, and a report must open offline without network errors.
REPORT_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
"""

STATUS_COLOURS = {"passed": "#1a7f37", "checks failed": "#b35900"}  # anything else: red
ERROR_COLOUR = "#c62828"

INDEX_CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
table { border-collapse: collapse; width: 100%; }
td, th { border-bottom: 1px solid #ddd; padding: .5rem .7rem; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } .files { font-size: .85em; } .meta { color: #666; }
"""


def index_row(notebook: str, html_name: str, status: str, summary: str, seconds: float, files: list[str]) -> str:
    """One table row: the report's link, its status, its one-line summary, its time and result files."""
    colour = STATUS_COLOURS.get(status, ERROR_COLOUR)
    links = ", ".join(f'<a href="{html.escape(notebook)}/{html.escape(f)}">{html.escape(f)}</a>' for f in files)
    return (
        f'<tr><td><a href="{html.escape(html_name)}">{html.escape(notebook)}</a></td>'
        f'<td style="color:{colour};font-weight:600">{status}</td>'
        f"<td>{html.escape(summary)}</td><td>{seconds:.0f} s</td><td class=files>{links}</td></tr>"
    )


def index_page(run_name: str, meta: str, rows: list[str]) -> str:
    """The run's ``index.html``: a title, one line of ``meta`` (plain text) and the rows."""
    newline = "\n"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>qwenkit reports: {html.escape(run_name)}</title>
<style>{INDEX_CSS}</style></head><body>
<h1>qwenkit reports: {html.escape(run_name)}</h1>
<p class="meta">{html.escape(meta)}</p>
<table><tr><th>notebook</th><th>status</th><th>summary</th><th>time</th><th>result files</th></tr>
{newline.join(rows)}
</table></body></html>
"""
