"""``distill.teacher``: where on-policy distillation's teacher is, and whether it can score the student's tokens.

The teacher is given as a run folder (its newest complete checkpoint), one ``step-N`` directory, or a
Hugging Face checkpoint directory (``config.json`` there). Before any rank starts, the launcher
(:func:`prepare`) exports a checkpoint once as ``<run>/hf-<step-N>`` (as ``model.init_from`` does,
:func:`qwenkit.engine.checkpoints.init_from.export_once`) and points ``distill.teacher`` there, so the
run's ``config.yaml`` records the weights it distilled from and every rank builds the same directory.

The check before spawn (:func:`problems`): the teacher is a checkpoint of the student's qwenkit family
(it scores the student's batches, their images' and videos' inputs as the student's processor made them) whose
tokenizer maps every token to the id the student's does (the teacher scores the student's token ids:
another vocabulary would score other words) and whose head covers the student's ids. A missing
teacher, or one of another family or tokenizer, is one line (exit 2).
"""

from __future__ import annotations

import json
from pathlib import Path

from qwenkit.engine.checkpoints import folder as checkpoint_dir
from qwenkit.engine.checkpoints.init_from import export_once
from qwenkit.model.families import registry as families
from qwenkit.model.families.entry import text_config

KEY = "distill.teacher"


def _hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def problem(teacher: str) -> str | None:
    """Why ``distill.teacher`` names no teacher (neither an HF directory nor a run with a checkpoint), or None."""
    path = Path(teacher).expanduser()
    if _hf_dir(path):
        return None
    try:
        checkpoint_dir.resolve(path)
    except checkpoint_dir.CheckpointError:
        what = "does not exist" if not path.exists() else "holds neither a config.json nor a complete checkpoint"
        return (f"{KEY}={teacher!r} {what}; give a Hugging Face checkpoint directory, a run folder with a "
                "checkpoint or a step-N directory")  # fmt: skip
    return None


def prepare(cfg) -> str | None:
    """Point ``distill.teacher`` at an HF directory (a checkpoint exported once); the one line to refuse the run
    with (no teacher there), or None."""
    teacher = cfg.distill.teacher  # set exactly under train.objective=distill (qwenkit.config.rules.distill)
    if not teacher:
        return None
    if said := problem(teacher):
        return f"qwenkit train: {said}"
    path = Path(teacher).expanduser()
    if not _hf_dir(path):
        cfg.distill.teacher = str(export_once(checkpoint_dir.resolve(path), KEY))
    return None


def problems(cfg, student: Path) -> list[str]:
    """What keeps ``distill.teacher`` (an HF directory after :func:`prepare`) from scoring the tokens of the
    student at ``student``: no teacher, a checkpoint of no family or of another, another tokenizer, a smaller head."""
    if not cfg.distill.teacher:  # set exactly under train.objective=distill (the config's rules)
        return []
    if said := problem(cfg.distill.teacher):
        return [said]
    path = Path(cfg.distill.teacher).expanduser()
    if not _hf_dir(path):  # a run's checkpoint the launcher exports (prepare): its tokenizer is the run's export's
        return []
    try:
        family = families.resolve("auto", path)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        return [f"{KEY}={cfg.distill.teacher!r}: {str(e).removeprefix('model.path=')}"]
    try:
        mine = families.resolve(cfg.model.name, student)
    except (ValueError, KeyError, json.JSONDecodeError):  # the student's own problem: families.problems says it
        return []
    if family.name != mine.name:
        return [f"{KEY}={cfg.distill.teacher!r} is a {family.name} checkpoint, the student ({str(student)!r}) a {mine.name}: "
                "the teacher scores the student's batches, their media inputs too; give a teacher of the student's family"]  # fmt: skip
    from transformers import AutoTokenizer  # the tokenizers only, no weights

    a, b = (AutoTokenizer.from_pretrained(p, local_files_only=True).get_vocab() for p in (student, path))
    if a != b:
        mine, theirs = ({i: t for t, i in v.items()} for v in (a, b))  # id -> token
        first = min(i for i in mine.keys() | theirs.keys() if mine.get(i) != theirs.get(i))
        return [f"{KEY}={cfg.distill.teacher!r} has another tokenizer than the student's {str(student)!r} "
                f"({len(b)} tokens vs {len(a)}; first difference: id {first} is {theirs.get(first)!r} for the teacher, "
                f"{mine.get(first)!r} for the student): the teacher must share the student's vocabulary (same tokenizer "
                "family)"]  # fmt: skip
    vocab = text_config(family, path).get("vocab_size", len(b))
    if vocab < len(a):
        return [f"{KEY}={cfg.distill.teacher!r}: its head scores {vocab} tokens, the student's tokenizer has {len(a)}"]
    return []


__all__ = ["prepare", "problem", "problems"]
