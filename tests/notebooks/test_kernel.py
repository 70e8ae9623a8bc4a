"""qwenkit.notebooks.kernel: what a notebook's cells call: paths against the project root from wherever
the kernel runs, the config with those paths, list parameters as typed text."""

from pathlib import Path

from qwenkit.notebooks import kernel

ROOT = Path(__file__).resolve().parents[2]


def test_paths_resolve_against_the_project_root_from_anywhere(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT / "notebooks")  # where JupyterLab runs a notebook
    assert kernel.project_root() == ROOT
    assert kernel.project_path("params/tiny_cpu.yaml") == ROOT / "params" / "tiny_cpu.yaml"
    assert kernel.project_path("/abs/x") == Path("/abs/x")
    cfg = kernel.load_config({"data.path": "../shared/x.json", "model.path": "tiny", "train.steps": 3})
    assert cfg.data.path == str((ROOT / "../shared/x.json").resolve()) and cfg.model.path == "tiny"
    assert cfg.train.steps == 3
