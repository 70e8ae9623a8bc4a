"""qwenkit.config.libraries: whether a library is installed, told without importing it."""

import sys
import types

from qwenkit.config import libraries


def test_installed_agrees_with_importing_without_importing():
    assert libraries.installed("json") and libraries.installed("torch")
    assert not libraries.installed("qwenkit_no_such_library")
    assert "qwenkit_no_such_library" not in sys.modules


def test_a_module_already_loaded_without_a_spec_counts(monkeypatch):
    """A module put in ``sys.modules`` by hand (a test double, a vendored copy) has no spec."""
    monkeypatch.setitem(sys.modules, "qwenkit_stand_in", types.ModuleType("qwenkit_stand_in"))
    assert libraries.installed("qwenkit_stand_in")
    monkeypatch.setitem(sys.modules, "qwenkit_stand_in", None)  # an import blocked on purpose
    assert not libraries.installed("qwenkit_stand_in")


def test_every_fused_backend_names_what_to_install():
    for backend, library in libraries.FUSED_LIBRARIES.items():
        assert library in libraries.PIP_NAMES, f"{backend}: {library} has no pip name"
