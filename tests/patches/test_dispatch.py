"""qwenkit.patches.dispatch: the route is chosen per call by the tensor's device; CPU tensors never
import a kernel library; a forward that no longer calls the op it patches is refused."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

import pytest

from qwenkit import patches
from qwenkit.bench.step import loss_and_grads
from qwenkit.patches import dispatch


class _ImportRecorder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.names = []

    def find_spec(self, name, path=None, target=None):
        self.names.append(name)
        return None


def test_cpu_tensors_never_import_kernel_libraries(make_model, batch_factory, monkeypatch):
    model = make_model(seed=0)
    patches.apply(model)  # the report may *look* for the libraries (find_spec); it must not import them
    recorder = _ImportRecorder()
    monkeypatch.setattr(sys, "meta_path", [recorder, *sys.meta_path])
    monkeypatch.setattr(dispatch, "_missing", set())
    loss_and_grads(model, batch_factory())
    tried = [n for n in recorder.names if n.split(".")[0] in ("torch_npu", "liger_kernel")]
    assert tried == []
    assert "torch_npu" not in sys.modules and "liger_kernel" not in sys.modules


def test_vision_rope_refuses_a_forward_that_no_longer_calls_it():
    with pytest.raises(patches.PatchError, match="does not call apply_rotary_pos_emb_vision"):
        dispatch.with_vision_rope(lambda self, x: x, dispatch.Router("auto"))
