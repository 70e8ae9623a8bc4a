"""qwenkit.config.schema: the whole config and its one validation pass: valid defaults, every problem
reported at once with its key path before any model is built, and no field that only the validator reads."""

import ast
import dataclasses
from pathlib import Path

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


def test_defaults_are_valid():
    cfg = config.load()
    assert cfg.loss.chunk and cfg.model.path == "tiny"


SECTIONS = {f.name: f.type if isinstance(f.type, type) else getattr(config, f.type) for f in dataclasses.fields(config.Config)}
# names a section goes by in the code: ``t = cfg.train``-style aliases are found, these are conventions
SECTION_NAMES = {"t": "train", "ck": "checkpoint", **{s: s for s in SECTIONS}, **{f"{s}_cfg": s for s in SECTIONS}}


def _section_reads(root: Path) -> set[str]:
    """``section.field`` for every read of a config field in ``root``'s code but the config package: ``cfg.train.lr``,
    ``t.lr`` after ``t = cfg.train``, ``data.path`` with ``data: DataConfig``, ``self.cfg.x`` after
    ``self.cfg = cfg.profile``, ``getattr(cfg.lora, "r")``. Reading ``model.path`` is not ``data.path``."""
    types = {cls.__name__: name for name, cls in SECTIONS.items()}
    reads: set[str] = set()
    for path in root.rglob("*.py"):
        if root / "config" in path.parents:
            continue
        tree = ast.parse(path.read_text(), str(path))
        aliases = dict(SECTION_NAMES)

        def section(node, aliases=aliases) -> str | None:
            if isinstance(node, ast.Attribute) and node.attr in SECTIONS:
                return node.attr
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "self":
                return aliases.get(f"self.{node.attr}")
            return aliases.get(node.id) if isinstance(node, ast.Name) else None

        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in [*node.args.args, *node.args.kwonlyargs]:
                    ann = arg.annotation
                    name = getattr(ann, "id", None) or getattr(ann, "attr", None) or getattr(ann, "value", None)
                    if isinstance(name, str) and name in types:
                        aliases[arg.arg] = types[name]
            if isinstance(node, ast.Assign):
                pairs = []
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += zip(target.elts, node.value.elts)
                    else:
                        pairs.append((target, node.value))
                for target, value in pairs:
                    s = section(value)
                    if s and isinstance(target, ast.Name):
                        aliases[target.id] = s
                    elif s and isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                        aliases[f"self.{target.attr}"] = s
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and (s := section(node.value)):
                reads.add(f"{s}.{node.attr}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2:
                s, name = section(node.args[0]), node.args[1]
                if s and isinstance(name, ast.Constant) and isinstance(name.value, str):
                    reads.add(f"{s}.{name.value}")
    return reads


def _unread(root: Path) -> list[str]:
    reads = _section_reads(root)
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls) if f"{s}.{f.name}" not in reads]


def test_every_config_field_is_read_outside_the_config_module():
    """A switch validated but read by nothing else does nothing: it must be used or removed."""
    unread = _unread(Path(config.__file__).parent.parent)
    assert not unread, f"config fields read by nothing but qwenkit/config/: {unread}"


def test_the_field_check_fails_on_a_field_read_only_under_another_section(tmp_path):
    (tmp_path / "run.py").write_text(
        "def f(cfg, data: 'DataConfig'):\n    t = cfg.train\n    return cfg.model.path, t.lr, data.layout\n"
    )
    reads = _section_reads(tmp_path)
    assert {"model.path", "train.lr", "data.layout"} <= reads and "data.path" not in reads
    assert "data.path" in _unread(tmp_path) and "model.path" not in _unread(tmp_path)


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as e:
        config.load(overrides=["train.steps=0", "loss.loss_type=raw", "train.lr=-1"])
    assert len(e.value.problems) == 3


