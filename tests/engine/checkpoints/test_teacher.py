"""qwenkit.engine.checkpoints.teacher: ``distill.teacher`` refused before any process starts, in one line and exit 2,
when it is missing, of another family, of another tokenizer or with a smaller head; the student's own checkpoint
passes. Through the launcher (``qwenkit train``, torchrun never started): one line, a ``refused`` event in a run
folder that exists."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import tiny_checkpoint
from jobs import refused

from qwenkit import config as qconfig
from qwenkit.engine.checkpoints import teacher
from qwenkit.engine.run import events

DISTILL = ["train.objective=distill", "grpo.num_generations=2", "grpo.max_new_tokens=4", "train.micro_batch_size=1"]


def _copy(tiny_path, tmp_path, name="teacher"):
    out = tmp_path / name
    shutil.copytree(tiny_path, out)
    return out


def _problems(tiny_path, where):
    cfg = qconfig.load(overrides=[*DISTILL, f"distill.teacher={where}"])
    return teacher.problems(cfg, tiny_path)


def test_the_students_own_checkpoint_is_a_teacher(tiny_path, tmp_path):
    assert _problems(tiny_path, tiny_path) == []
    assert _problems(tiny_path, _copy(tiny_path, tmp_path)) == []


def test_a_missing_teacher_is_one_line(tiny_path, tmp_path):
    (missing,) = _problems(tiny_path, tmp_path / "nowhere")
    assert missing.startswith(f"distill.teacher={str(tmp_path / 'nowhere')!r} does not exist; give a Hugging Face")
    (tmp_path / "empty").mkdir()
    (empty,) = _problems(tiny_path, tmp_path / "empty")
    assert "holds neither a config.json nor a complete checkpoint" in empty


def test_a_teacher_of_another_family_is_refused(tiny_path):
    other = tiny_checkpoint("qwen3_vl")
    (line,) = _problems(tiny_path, other)
    assert line == (f"distill.teacher={str(other)!r} is a qwen3_vl checkpoint, the student ({str(tiny_path)!r}) a qwen2_5_vl: "
                    "the teacher scores the student's batches, their media inputs too; give a teacher of the student's family")  # fmt: skip


def test_a_teacher_of_another_tokenizer_is_refused_naming_the_first_difference(tiny_path, tmp_path):
    other = _copy(tiny_path, tmp_path)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["!"], vocab['"'] = vocab['"'], vocab["!"]  # two ids swapped: the same tokens, other meanings
    (other / "tokenizer.json").write_text(json.dumps(spec))
    (line,) = _problems(tiny_path, other)
    assert line.startswith(f"distill.teacher={str(other)!r} has another tokenizer than the student's {str(tiny_path)!r}")
    assert "first difference: id 0 is '\"' for the teacher, '!' for the student)" in line
    assert line.endswith("must share the student's vocabulary (same tokenizer family)")


def test_a_teacher_whose_head_is_smaller_than_the_students_vocabulary_is_refused(tiny_path, tmp_path):
    other = _copy(tiny_path, tmp_path)
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["vocab_size"] = 300
    (other / "config.json").write_text(json.dumps(config))
    (line,) = _problems(tiny_path, other)
    assert line.startswith(f"distill.teacher={str(other)!r}: its head scores 300 tokens, the student's tokenizer has")


@pytest.mark.parametrize("fault", ["missing", "family"])
def test_the_launcher_refuses_a_bad_teacher_in_one_line_before_spawn(fault, tmp_path, capsys):
    where = tmp_path / "nowhere" if fault == "missing" else tiny_checkpoint("qwen3_vl")
    out = tmp_path / "run"
    assert refused(out, *DISTILL, f"distill.teacher={where}", steps=1) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("qwenkit train:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"distill.teacher={str(where)!r}" in lines[0]
    assert not out.exists()  # a new run's folder is not made for a refused start
    out.mkdir()  # a run's folder there: the refusal is recorded in its events
    assert refused(out, *DISTILL, f"distill.teacher={where}", steps=1) == 2
    (failed,) = [e for e in events.read(out) if e["event"] == "failed"]
    assert failed["error"] == "refused" and failed["exit_code"] == 2 and failed["summary"] == lines[0], failed
