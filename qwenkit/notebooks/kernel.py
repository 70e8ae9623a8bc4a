"""Kernel-side helpers: what every notebook calls in its first cells, inside the Jupyter kernel.

Paths in a notebook's parameters mean the same file whether JupyterLab runs it from
``notebooks/`` or the runner (:mod:`qwenkit.notebooks.runner`) runs it through papermill:
:func:`project_path` resolves them against the checkout. :func:`setup` prepares plotting and
logging, :func:`load_config` turns parameters into a validated config, :func:`show_results`
ends a notebook by listing what it wrote.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch

from qwenkit import config as qconfig
from qwenkit.device import resolve_device
from qwenkit.notebooks import renderer, results


def project_root(start: str | Path | None = None) -> Path:
    """The checkout holding ``notebooks/`` and ``params/``: above ``start`` (default: cwd), else the package's."""
    here = Path(start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "notebooks").is_dir() and (d / "params").is_dir() and (d / "qwenkit").is_dir():
            return d
    src = Path(__file__).resolve().parents[2]  # qwenkit/notebooks/kernel.py -> the checkout
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
    renderer.setup()
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


def device(name: str = "auto") -> torch.device:
    """The notebook's ``device`` parameter as a torch device, by the trainer's rule (:func:`qwenkit.device.resolve_device`)."""
    return torch.device(resolve_device(name, key="device"))
