"""Open an HTML file in headless Chromium and report what drew and what went wrong.

Drives Chromium over the DevTools protocol (``websocket-client``): navigates to the file, waits
until the number of drawn plotly charts stops changing, and returns the page's JS exceptions,
console errors and every request that left the file (a standalone report makes none).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--remote-debugging-port=0", "--remote-allow-origins=*",
]  # fmt: skip

# For each plotly div: drew an SVG (.main-svg), and how many data traces it drew.
PROBE = """(() => {
  const divs = [...document.querySelectorAll('.plotly-graph-div')];
  return JSON.stringify(divs.map(d => ({
    svg: d.querySelectorAll('svg.main-svg').length,
    traces: d.querySelectorAll('g.trace, g.table').length,
    plotly: typeof window.Plotly !== 'undefined',
  })));
})()"""


def executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageReport:
    charts: list[dict] = field(default_factory=list)  # per plotly div: svg count, trace count
    exceptions: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)


def open_page(path: str | Path, timeout_s: float = 60.0) -> PageReport:
    import websocket

    profile = tempfile.mkdtemp(prefix="qwenkit-chromium-")
    proc = subprocess.Popen(
        [executable(), *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port = _devtools_port(Path(profile), proc, timeout_s)
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t["type"] == "page")
        ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=timeout_s, suppress_origin=True)
        try:
            return _drive(ws, Path(path).resolve().as_uri(), timeout_s, websocket.WebSocketTimeoutException)
        finally:
            ws.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(profile, ignore_errors=True)


def _devtools_port(profile: Path, proc: subprocess.Popen, timeout_s: float) -> int:
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with code {proc.returncode} before opening DevTools")
        if marker.is_file() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        time.sleep(0.1)
    raise TimeoutError("chromium did not open its DevTools port")


def _drive(ws, url: str, timeout_s: float, timeout_error: type[Exception]) -> PageReport:
    report = PageReport()
    next_id = iter(range(1, 10**6))
    pending: dict[int, dict] = {}

    def send(method: str, **params) -> int:
        i = next(next_id)
        ws.send(json.dumps({"id": i, "method": method, "params": params}))
        return i

    def pump(until_id: int | None = None, until_event: str | None = None, deadline: float = 0.0):
        while time.monotonic() < deadline:
            ws.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                msg = json.loads(ws.recv())
            except timeout_error:
                return None
            if "id" in msg:
                pending[msg["id"]] = msg
                if msg["id"] == until_id:
                    return msg
                continue
            _record(report, msg)
            if msg.get("method") == until_event:
                return msg
        return None

    deadline = time.monotonic() + timeout_s
    for method in ("Runtime.enable", "Log.enable", "Network.enable", "Page.enable"):
        pump(until_id=send(method), deadline=deadline)
    send("Page.navigate", url=url)
    if pump(until_event="Page.loadEventFired", deadline=deadline) is None:
        raise TimeoutError(f"{url} did not finish loading in {timeout_s} s")
    last, stable_since = None, time.monotonic()
    while time.monotonic() < deadline:  # plotly draws asynchronously: wait until nothing changes
        reply = pump(until_id=send("Runtime.evaluate", expression=PROBE, returnByValue=True), deadline=deadline)
        charts = json.loads(reply["result"]["result"]["value"])
        if charts != last:
            last, stable_since = charts, time.monotonic()
        elif time.monotonic() - stable_since > 1.5:
            break
        pump(deadline=time.monotonic() + 0.3)
    report.charts = last or []
    return report


def _record(report: PageReport, msg: dict) -> None:
    method, params = msg.get("method"), msg.get("params", {})
    if method == "Runtime.exceptionThrown":
        d = params["exceptionDetails"]
        report.exceptions.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
    elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
        report.console_errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
    elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
        report.console_errors.append(params["entry"]["text"])
    elif method == "Network.requestWillBeSent":
        url = params["request"]["url"]
        if not url.startswith(("file:", "data:", "about:", "blob:")):
            report.external_requests.append(url)


def available_reason() -> str | None:
    """Why the browser test cannot run here, or None."""
    if executable() is None:
        return "chromium is not installed (Debian: apt-get install -y chromium)"
    try:
        import websocket  # noqa: F401
    except ImportError:
        return "websocket-client is not installed (pip install websocket-client)"
    return None
