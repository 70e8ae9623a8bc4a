"""Headless Chromium for the browser tests: Debian's ``chromium`` driven by Playwright.

``playwright install`` downloads its own browser, which these machines cannot; :func:`launch` starts
the system's ``chromium`` instead (Playwright speaks its DevTools protocol). :func:`open_page` opens
an HTML file and reports what drew and what went wrong; :func:`poke_chart` does to one plotly chart
what a reader does (a legend click, a zoom, a narrower window) and measures it after each, in a
rendered report or in JupyterLab (:mod:`jupyterlab`).
"""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
VIEWPORT = {"width": 1400, "height": 1000}

# For each plotly div: drew an SVG (.main-svg), and how many data traces it drew.
PROBE = """() => [...document.querySelectorAll('.plotly-graph-div')].map(d => ({
    svg: d.querySelectorAll('svg.main-svg').length,
    traces: d.querySelectorAll('g.trace, g.table').length,
    plotly: typeof window.Plotly !== 'undefined',
}))"""
SIZE = "e => { const r = e.getBoundingClientRect(); return [Math.round(r.width), Math.round(r.height)]; }"


def executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def available_reason() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if executable() is None:
        return "chromium is not installed (Debian: apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    return None


@contextmanager
def launch():
    """A headless Chromium (the system's) under Playwright; yields the browser."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable(), args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@dataclass
class PageReport:
    charts: list[dict] = field(default_factory=list)  # per plotly div: svg count, trace count
    exceptions: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)


def watch(page, report: PageReport) -> PageReport:
    """Record ``page``'s JS exceptions, console errors and requests that leave the file into ``report``."""
    page.on("pageerror", lambda e: report.exceptions.append(str(e)))
    page.on("console", lambda m: report.console_errors.append(m.text) if m.type in ("error", "assert") else None)
    page.on("request", lambda r: None if r.url.startswith(("file:", "data:", "about:", "blob:"))
            else report.external_requests.append(r.url))  # fmt: skip
    return report


def settle_charts(page, timeout_s: float = 60.0) -> list[dict]:
    """Wait until the drawn plotly charts stop changing (plotly draws asynchronously); returns :data:`PROBE`'s."""
    deadline = time.monotonic() + timeout_s
    last, stable_since = None, time.monotonic()
    while time.monotonic() < deadline:
        charts = page.evaluate(PROBE)
        if charts != last:
            last, stable_since = charts, time.monotonic()
        elif time.monotonic() - stable_since > 1.5:
            break
        page.wait_for_timeout(300)
    return last or []


def open_page(path: str | Path, timeout_s: float = 60.0, check=None) -> PageReport:
    """Open an HTML file and report its charts, errors and outside requests; ``check(page)``, if
    given, runs on the loaded page before the browser closes."""
    with launch() as browser:
        page = browser.new_page(viewport=VIEWPORT)
        report = watch(page, PageReport())
        page.goto(Path(path).resolve().as_uri(), timeout=timeout_s * 1000)
        report.charts = settle_charts(page, timeout_s)
        if check is not None:
            check(page)
        return report


def chart_sizes(page) -> list[list[int]]:
    """Width and height in px of every drawn plotly chart on ``page``."""
    return page.eval_on_selector_all(".js-plotly-plot", f"els => els.map({SIZE})")


def charts_with_legend(page) -> list[int]:
    """Indices (among ``.js-plotly-plot``) of the charts that have a clickable legend entry."""
    return page.eval_on_selector_all(".js-plotly-plot", "els => els.map((e, i) => "
                                     "e.querySelector('g.legend rect.legendtoggle') ? i : -1).filter(i => i >= 0)")  # fmt: skip


def poke_chart(page, index: int, pause_ms: int = 800) -> dict[str, list[int]]:
    """Click the first legend entry of chart ``index``, drag a zoom box over its plot area, and
    narrow the window; its ``[width, height]`` before and after each (the window is restored)."""
    chart = page.locator(".js-plotly-plot").nth(index)
    chart.scroll_into_view_if_needed()
    sizes = {"before": chart.evaluate(SIZE)}
    chart.locator("g.legend rect.legendtoggle").first.click()
    page.wait_for_timeout(pause_ms)
    sizes["legend click"] = chart.evaluate(SIZE)
    box = chart.locator("rect.nsewdrag").first.bounding_box()
    x, y, w, h = box["x"], box["y"], box["width"], box["height"]
    page.mouse.move(x + w * 0.3, y + h * 0.3)
    page.mouse.down()
    page.mouse.move(x + w * 0.6, y + h * 0.6, steps=5)
    page.mouse.up()
    page.wait_for_timeout(pause_ms)
    sizes["zoom"] = chart.evaluate(SIZE)
    viewport = page.viewport_size
    page.set_viewport_size({"width": viewport["width"] * 2 // 3, "height": viewport["height"]})
    page.wait_for_timeout(pause_ms * 2)
    sizes["narrower window"] = chart.evaluate(SIZE)
    page.set_viewport_size(viewport)
    page.wait_for_timeout(pause_ms)
    return sizes


def assert_keeps_size(sizes: dict[str, list[int]]) -> None:
    """A chart keeps its height through :func:`poke_chart` (plotly's layout height) and stays drawn."""
    width, height = sizes["before"]
    assert width > 100 and height > 100, sizes
    for what, (w, h) in sizes.items():
        assert h == height and w > 100, f"after the {what} the chart is {w} x {h} px, was {width} x {height}: {sizes}"
