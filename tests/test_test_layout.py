"""Tests you find by name: ``qwenkit/<package>/<module>.py`` is tested in
``tests/<package>/test_<module>.py`` (a top-level module in ``tests/test_<module>.py``), for at least
:data:`MIN_NAMED` of the modules; a concern that spans modules has a file named after it beside them
(docs/TESTING.md, "Where tests live")."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import PACKAGE, package_modules

TESTS = Path(__file__).resolve().parent
MIN_NAMED = 0.85  # of qwenkit's modules (package __init__ files not counted)


def named_test_file(path: Path) -> Path:
    """Where the tests of the module at ``path`` live. A config section's rules
    (``config/rules/grpo.py``) are tested with its fields, through ``config.load``, in its file
    (``tests/config/test_grpo.py``)."""
    relative = path.relative_to(PACKAGE)
    if relative.parent == Path("config", "rules"):
        relative = Path("config", relative.name)
    return TESTS / relative.parent / f"test_{relative.stem}.py"


def _modules() -> dict[str, Path]:
    return {name: path for name, path in package_modules().items() if path.name != "__init__.py"}


def test_most_modules_have_a_test_file_named_after_them():
    modules = _modules()
    without = sorted(name for name, path in modules.items() if not named_test_file(path).is_file())
    share = 1 - len(without) / len(modules)
    assert share >= MIN_NAMED, (
        f"{share:.0%} of the {len(modules)} modules have a test file named after them, at least {MIN_NAMED:.0%} "
        f"must; without one: {', '.join(without)}"
    )


def test_named_test_files_hold_tests():
    for path in _modules().values():
        test_file = named_test_file(path)
        if test_file.is_file():
            tree = ast.parse(test_file.read_text())
            tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
            assert tests, f"{test_file.relative_to(TESTS.parent)} holds no test"


def test_test_folders_mirror_the_package():
    """A folder of tests is a qwenkit package's, and a package (so two modules of one name, e.g.
    config/checkpoint.py and engine/checkpoints/dcp.py, each have their test_checkpoint.py)."""
    packages = {path.parent.relative_to(PACKAGE) for path in PACKAGE.rglob("__init__.py")}
    for folder in sorted({p.parent for p in TESTS.rglob("test_*.py")} - {TESTS}):
        relative = folder.relative_to(TESTS)
        assert relative in packages, f"tests/{relative}/ mirrors no qwenkit package (qwenkit/{relative}/)"
        assert (folder / "__init__.py").is_file(), f"tests/{relative}/ needs an __init__.py"
