"""qwenkit.notebooks.runner: notebook selection, list parameters, the cell timeout, HTML rendering of
a failed notebook, the index (paths against the project root: test_kernel.py; widgets: test_widgets.py)."""

from pathlib import Path

import nbformat
import pytest

from qwenkit import cli
from qwenkit.notebooks import kernel, runner

ROOT = Path(__file__).resolve().parents[2]
NBS = [Path(f"/x/notebooks/{n}.ipynb") for n in ("01_data_prep", "02_sharded_training", "03_chunk_loss_validation")]


def test_select_by_number_name_or_stem():
    assert runner.select(NBS, None) == NBS
    assert runner.select(NBS, ["3", "01"]) == [NBS[0], NBS[2]]
    assert runner.select(NBS, ["sharded_training", "02_sharded_training.ipynb"]) == [NBS[1]]
    with pytest.raises(ValueError, match="--only '7' matches no notebook"):
        runner.select(NBS, ["7"])


def test_list_parameters():
    assert kernel.int_list("7, 64,1024") == [7, 64, 1024]
    assert kernel.str_list("text, image-text,") == ["text", "image-text"]
    with pytest.raises(ValueError, match="comma-separated integers"):
        kernel.int_list("7,big")


def _notebook(folder: Path, name: str, code: str, params: str = "") -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell(params + 'output_dir = "x"  # where results go')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {name}"), params, nbformat.v4.new_code_cell(code)]
    src = folder / "notebooks" / f"{name}.ipynb"
    src.parent.mkdir(exist_ok=True)
    nbformat.write(nb, str(src))
    return src


def test_a_cell_past_the_cell_timeout_fails_its_notebook(tmp_path):
    src = _notebook(tmp_path, "09_hung", "import time\ntime.sleep(600)  # a cell that never returns")
    outcome = runner.execute(src, tmp_path / "reports", "smoke", {}, cell_timeout=1)
    assert outcome.status == "error" and "timed out" in outcome.summary.lower(), outcome.summary
    assert outcome.seconds < 300  # the cell's 600 s did not run out


def test_qwenkit_notebooks_run_takes_the_cell_timeout(tmp_path, capsys):
    """Through the command: notebook 01's first code cell (imports, seconds) runs past 1 s and
    fails it (exit 1); a timeout of 0 is refused in one line before any notebook runs (exit 2)."""
    out = tmp_path / "reports"
    assert cli.main(["notebooks", "run", "--params", "smoke", "--only", "01", "--out", str(out),
                     "--cell-timeout", "1"]) == 1  # fmt: skip
    assert "CellTimeoutError" in (out / "latest" / "index.html").read_text()
    capsys.readouterr()
    assert cli.main(["notebooks", "run", "--only", "01", "--out", str(tmp_path / "r2"), "--cell-timeout", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "--cell-timeout must be a whole number of seconds > 0, got 0" in err, err
    assert not (tmp_path / "r2").exists()


def test_a_batch_run_overrides_a_persons_defaults(tmp_path):
    """A notebook's own ``interactive = True`` is for JupyterLab; the runner runs it with False, and
    a parameter set may not ask for widgets in a report."""
    src = _notebook(tmp_path, "09_widgets", "assert interactive is False, interactive",
                    params="interactive = True  # widgets\n")  # fmt: skip
    outcome = runner.execute(src, tmp_path / "reports", "smoke", {})
    assert outcome.error is None and outcome.values["interactive"] is False
    (tmp_path / "params" / "09_widgets").mkdir(parents=True)
    (tmp_path / "params" / "09_widgets" / "live.yaml").write_text("interactive: true\n")
    with pytest.raises(ValueError, match="'interactive' is set by the runner for every batch run"):
        runner.load_params(src, "live", tmp_path)
    plain = _notebook(tmp_path, "09_plain", "pass")
    assert runner.batch_parameters(plain, {"a": 1}) == {"a": 1}  # only the parameters a notebook has


def test_a_failed_notebook_is_rendered_and_indexed(tmp_path):
    src = _notebook(tmp_path, "09_broken", "1 / 0")
    out = tmp_path / "reports"
    outcome = runner.execute(src, out, "smoke", {})
    assert outcome.status == "error" and "ZeroDivisionError" in outcome.summary
    page = outcome.html.read_text()
    assert "ZeroDivisionError" in page and "The notebook stopped with an error" in page
    index = runner.write_index(out, [outcome], "r1", "smoke").read_text()
    assert 'href="09_broken.html"' in index and ">error<" in index


