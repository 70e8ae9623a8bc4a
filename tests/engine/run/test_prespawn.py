"""qwenkit.engine.run.prespawn: a dataset of the wrong layout (a DPO file given to GRPO) is one line.
The first start scans it in the ranks: exit 1, one line naming the file and row, no traceback, not
once per rank. Its index is cached then, so the next start is refused before any rank starts:
exit 2, the same line, a ``refused`` event beside the first start's ``failed``. The same for the
training set and for ``data.eval_path``."""

from __future__ import annotations

import json

import pytest
from jobs import refused, train

from qwenkit.engine.run import events


def _dpo_rows(path):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]} for i in range(6)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ours(err: str) -> list[str]:
    """The launcher's and the ranks' lines (not the command line it echoes, nor logged warnings)."""
    return [line for line in err.splitlines() if line.startswith("qwenkit train:") and "qwenkit.torchrun" not in line]


def _prompt_rows(path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("where", ["data.path", "data.eval_path"])
def test_a_file_of_another_objective_is_one_line_in_the_ranks_then_refused_before_spawn(where, tmp_path, capsys):
    dpo = _dpo_rows(tmp_path / "dpo.jsonl")
    sets = [f"data.path={dpo}"] if where == "data.path" else [f"data.path={_prompt_rows(tmp_path / 'p.jsonl')}",
                                                             f"data.eval_path={dpo}", "train.eval_every=1"]  # fmt: skip
    run = ["train.objective=grpo", *sets, f"data.cache_dir={tmp_path / 'cache'}", "grpo.num_generations=2",
           "grpo.max_new_tokens=2"]  # fmt: skip
    out = tmp_path / "run"
    first = train(out, *run, steps=1, nproc=2)
    assert first.returncode == 1, first.stderr[-3000:]
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    (line,) = _ours(first.stderr)
    assert line.startswith("qwenkit train: 6 of 6 samples (100.0%) are bad, more than data.max_bad_fraction=0.01")
    assert f"first: {dpo}: row 0 (line 1): bad_format: a preference row" in line
    assert refused(out, *run, steps=1, nproc=2) == 2
    err = capsys.readouterr().err
    (again,) = [x for x in err.splitlines() if x.startswith("qwenkit train:")]
    assert again.startswith("qwenkit train: invalid run: 6 of 6 samples (100.0%) are bad") and "Traceback" not in err, err
    failed = [e for e in events.read(out) if e["event"] == "failed"]
    assert failed[0]["by"] == "rank" and failed[0]["input"] and failed[-1]["error"] == "refused", failed
