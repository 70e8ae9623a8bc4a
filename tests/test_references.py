"""Docstrings and comments in qwenkit/ name only things that exist.

Every ``qwenkit.x.y`` dotted name and every Sphinx-role target (``:func:``, ``:class:``,
``:meth:``, ``:mod:``, ``:attr:``, ``:data:``, ``:exc:``) in the package's source is resolved by
import: the longest importable module prefix, then attributes. Role targets without the package
prefix resolve against the module they appear in (or a class in it); a leading ``.`` is relative
to the module's package. A rename that leaves a stale reference behind fails here.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
from conftest import package_modules

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "qwenkit"
ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc):`~?([A-Za-z_.][\w.]*)`")
DOTTED = re.compile(r"(?<![\w/.-])qwenkit(?:\.[A-Za-z_]\w*)+")


class Optional(Exception):
    """The name lives behind an optional dependency that is not installed here."""


MODULES = package_modules()


def _resolve_dotted(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith(".".join(parts[:1])) and ".".join(parts[:i]) in MODULES:
                raise Optional(e.name) from None
            continue
        except ImportError as e:
            raise Optional(str(e)) from None
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def resolves(target: str, module: str) -> bool:
    """Whether ``target`` (a role target or a dotted name) names something that exists, seen from ``module``."""
    target = target.lstrip("~").rstrip(".")
    if target.startswith("."):
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        level = len(target) - len(target.lstrip("."))
        base = package.rsplit(".", level - 1)[0] if level > 1 else package
        return _resolve_dotted(f"{base}.{target.lstrip('.')}")
    if target.split(".")[0] == "qwenkit":
        return _resolve_dotted(target)
    if _resolve_dotted(f"{module}.{target}"):
        return True
    owner = importlib.import_module(module)
    classes = [c for _, c in inspect.getmembers(owner, inspect.isclass) if c.__module__ == module]
    if any(_resolve_dotted(f"{module}.{c.__qualname__}.{target}") for c in classes):
        return True
    return _resolve_dotted(target)  # an outside name (torch.utils.flop_counter, ...)


def references() -> list[tuple[str, int, str]]:
    """``(module, line, target)`` for every role target and ``qwenkit.`` dotted name in the source."""
    out = []
    for module, path in MODULES.items():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for pattern in (ROLE, DOTTED):
                out += [(module, lineno, m.group(1) if m.groups() else m.group(0)) for m in pattern.finditer(line)]
    return out


def test_every_reference_in_the_package_exists():
    missing = []
    for module, line, target in references():
        try:
            ok = resolves(target, module)
        except Optional:
            continue
        if not ok:
            missing.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {target}")
    assert not missing, "docstrings/comments name things that do not exist:\n" + "\n".join(missing)


def test_the_resolver_tells_a_stale_name_from_a_live_one():
    assert references()  # the scan finds references at all
    assert resolves("qwenkit.engine.run.optim.build_scheduler", "qwenkit.config")
    assert not resolves("qwenkit.engine.run.train.seek_schedule", "qwenkit.config")  # the stale name of issue #21
    assert resolves(":func:`load`".split("`")[1], "qwenkit.config") and not resolves("lode", "qwenkit.config")
    assert resolves(".reader", "qwenkit.data") and not resolves(".readers", "qwenkit.data")
    assert resolves("Evaluator.due", "qwenkit.engine.generation.evaluate") and resolves("due", "qwenkit.engine.generation.evaluate")
    with pytest.raises(AssertionError):
        assert resolves("qwenkit.patches.OPZ", "qwenkit.config")


DOCS = sorted((ROOT / "docs").glob("*.md"))
PY_PATH = re.compile(r"`([\w./-]+\.py)`")


def doc_references(paths: list[Path]) -> list[tuple[Path, int, str, str]]:
    """``(doc, line, kind, target)``: each ``qwenkit.`` dotted name (kind ``name``) and each
    backticked ``.py`` path (kind ``file``) in ``paths``."""
    out = []
    for doc in paths:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            out += [(doc, lineno, "name", m.group(0)) for m in DOTTED.finditer(line)]
            out += [(doc, lineno, "file", m.group(1)) for m in PY_PATH.finditer(line)]
    return out


def _file_exists(target: str) -> bool:
    """``a/b.py`` from the repository root, the package or tests/ (``engine/run/test_optim.py``); a bare
    ``b.py`` anywhere in the repository."""
    if "/" in target:
        return any((base / target).is_file() for base in (ROOT, PACKAGE, ROOT / "tests"))
    return any(p.is_file() for d in ("qwenkit", "tests", "benchmarks", "scripts") for p in (ROOT / d).rglob(target))


def _doc_missing(paths: list[Path]) -> list[str]:
    missing = []
    for doc, line, kind, target in doc_references(paths):
        try:
            ok = resolves(target, "qwenkit") if kind == "name" else _file_exists(target)
        except Optional:
            continue
        if not ok:
            missing.append(f"{doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc.name}:{line}: {target}")
    return missing


def test_every_reference_in_the_docs_exists():
    assert DOCS and doc_references(DOCS)
    missing = _doc_missing(DOCS)
    assert not missing, "docs/ name modules, functions or files that do not exist:\n" + "\n".join(missing)


def test_the_docs_check_finds_a_stale_name_and_a_missing_file(tmp_path):
    doc = tmp_path / "X.md"
    doc.write_text("See `qwenkit.engine.ledger.final_metrics` in `engine/ledger.py`; `engine/run/events.py` stays.\n")
    assert _doc_missing([doc]) == ["X.md:1: qwenkit.engine.ledger.final_metrics", "X.md:1: engine/ledger.py"]
