"""A JupyterLab for the browser tests, and what a person does in it.

:func:`project_copy` lays out a scratch project (the notebooks copied, with parameters injected as
papermill injects them; ``params/`` and ``qwenkit/`` linked) so that nothing a run writes or saves
lands in the checkout. :class:`Lab` serves it on 127.0.0.1 with a token, as ``make lab`` serves
the checkout. :class:`Notebook` opens one in a Playwright page, runs all cells from the Run menu,
and reads what the page shows.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STDERR = "application/vnd.jupyter.stderr"
# The frontend's settings for a test: no autosave (runs are never written back), no news pop-up
# over the charts.
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
}


def project_copy(dest: Path, notebooks: dict[str, dict[str, Any]]) -> Path:
    """``dest`` as a project root holding ``notebooks/<name>.ipynb`` with ``notebooks[name]``
    injected (none: the notebook's own defaults) and links to the checkout's params and package."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    (dest / "notebooks").mkdir(parents=True)
    for name in ("params", "qwenkit"):
        (dest / name).symlink_to(ROOT / name)
    for name, values in notebooks.items():
        nb = load_notebook_node(str(ROOT / "notebooks" / f"{name}.ipynb"))
        if values:
            nb = parameterize_notebook(nb, values, kernel_name="python3")
        nbformat.write(nb, str(dest / "notebooks" / f"{name}.ipynb"))
    return dest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """``jupyter lab`` over ``root`` on 127.0.0.1 with a fresh token; a context manager."""

    def __init__(self, root: Path, timeout_s: float = 120.0):
        self.root, self.port, self.token = root, _free_port(), secrets.token_hex(16)
        state = root / ".lab"
        for path, value in SETTINGS.items():
            (state / "settings" / path).parent.mkdir(parents=True, exist_ok=True)
            (state / "settings" / path).write_text(json.dumps(value))
        cmd = [
            sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
            f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
            f"--LabApp.user_settings_dir={state / 'settings'}", f"--LabApp.workspaces_dir={state / 'workspaces'}",
            "--LabApp.news_url=", *(["--allow-root"] if os.geteuid() == 0 else []),
        ]  # fmt: skip
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_RUNTIME_DIR=str(state / "runtime"))
        self.log = state / "lab.log"
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(self.url("api/status"), timeout=5)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"JupyterLab did not start; {self.log}:\n{self.log.read_text()[-2000:]}") from None
                time.sleep(0.3)

    def url(self, path: str, query: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/{path}?{query + '&' if query else ''}token={self.token}"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Notebook:
    """One notebook open in a JupyterLab tab of ``page``."""

    def __init__(self, page, lab: Lab, name: str, timeout_s: float = 120.0):
        self.page, self.name = page, name
        # reset: a fresh workspace, not the tabs an earlier test opened
        page.goto(lab.url(f"lab/tree/notebooks/{name}.ipynb", "reset"), timeout=timeout_s * 1000)
        page.wait_for_selector(".jp-Notebook", timeout=timeout_s * 1000)
        page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=timeout_s * 1000)  # the kernel is up

    def prompts(self) -> list[str]:
        """Every code cell's prompt: ``[ ]`` not run, ``[*]`` queued or running, ``[3]`` done."""
        return [p.strip(" :") for p in self.page.eval_on_selector_all(
            ".jp-CodeCell .jp-InputArea-prompt", "els => els.map(e => e.textContent)")]  # fmt: skip

    def run_all(self, timeout_s: float) -> list[str]:
        """Run > Run All Cells, then wait until no cell is queued or running; returns the prompts."""
        self.page.click("div.lm-MenuBar-itemLabel:text-is('Run')")
        self.page.click("li.lm-Menu-item:has-text('Run All Cells')")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            prompts = self.prompts()
            started = any(p != "[ ]" for p in prompts)
            if started and "[*]" not in prompts and (all(p[1:-1].isdigit() for p in prompts) or self.errors()):
                return prompts
            self.page.wait_for_timeout(1000)
        raise TimeoutError(f"{self.name}: cells still running after {timeout_s:.0f} s: {self.prompts()}")

    def errors(self) -> list[str]:
        """The error outputs (tracebacks) on the page; warnings on stderr are not errors."""
        texts = self.page.eval_on_selector_all(f".jp-OutputArea-output[data-mime-type='{STDERR}']",
                                               "els => els.map(e => e.innerText)")  # fmt: skip
        return [t for t in texts if "Traceback" in t or "Error" in t.splitlines()[0]]

    def widgets(self):
        """The ipywidgets the outputs rendered (a widget that failed to render is text, not these)."""
        return self.page.locator(".jp-OutputArea-output .jupyter-widgets.widget-container, "
                                 ".jp-OutputArea-output .widget-vbox")  # fmt: skip
