"""qwenkit.patches.dispatch: the route is chosen per call by the tensor's device; CPU tensors never
import a kernel library; a forward that no longer calls the op it patches is refused; Qwen4-Exp's
zero-centred RMSNorms take the offset kernels."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

import pytest
import torch
from conftest import over_families

from patches.doubles import assert_bitwise, assert_close_run, fake_liger, fake_torch_npu
from qwenkit import patches
from qwenkit.bench.step import loss_and_grads
from qwenkit.patches import dispatch, targets


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


@over_families("qwen4_exp")
@pytest.mark.parametrize("device", ["npu", "cuda"])
def test_zero_centred_norms_run_the_original_on_cpu_and_the_offset_kernel_on_the_device(
    family, device, make_model, batch_factory, monkeypatch
):
    """Qwen4-Exp's RMSNorms scale by ``1 + weight`` in fp32: on CPU tensors HF's own forward (bitwise), on
    "device" tensors (a test predicate, plain-torch doubles of the libraries) torch_npu's kernel with
    ``gamma = 1 + weight`` or Liger's with ``offset=1.0, casting_mode="gemma"``, for every ungrouped norm, loss
    and every gradient as HF's; the norms over groups of streams keep HF's forward."""
    calls = []
    if device == "npu":
        monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(calls))
    else:
        liger = fake_liger(calls)
        for name, module in liger.items():
            monkeypatch.setitem(sys.modules, name, module)
        rms = liger["liger_kernel.transformers.functional"].liger_rms_norm
        offsets = []

        def recording(X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
            offsets.append(offset)
            return rms(X, W, eps, offset, casting_mode, in_place)

        liger["liger_kernel.transformers.functional"].liger_rms_norm = recording
    on_device = False
    model = make_model(seed=0)
    norms = {id(m.weight): m for _, m in targets.find(model, "rms_norm")}
    with torch.no_grad():  # HF initialises them at 0: each its own weight, for the gammas to tell them apart
        for m in norms.values():
            m.weight.normal_(0.0, 0.1)
    batch = batch_factory()
    reference = loss_and_grads(model, batch)
    report = patches.apply(model, ops=["rms_norm"], device_of=lambda t: device if on_device else t.device.type)
    assert norms and all(targets.zero_centred(type(m)) for m in norms.values())
    grouped = [m for m in model.modules() if getattr(m, "group_size", None) and type(m).__name__.endswith("RMSNorm")]
    assert grouped and all("_qwenkit_patch" not in m.__dict__ for m in grouped)
    assert [r.modules for r in report.ops if r.op == "rms_norm"] == [len(norms)]
    assert_bitwise(loss_and_grads(model, batch), reference)  # CPU tensors: HF's forward
    assert calls == []

    on_device = True
    assert_close_run(loss_and_grads(model, batch), reference)
    kernel = {"npu": "npu_rms_norm", "cuda": "liger_rms_norm"}[device]
    used = [c for c in calls if c[0] == kernel]
    if device == "npu":  # gamma is a fresh 1 + w: matched to its norm by value
        weights = [m.weight for m in norms.values()]
        assert all(any(torch.equal(c[2], 1.0 + w.float()) for w in weights) for c in used)
        assert all(any(torch.equal(c[2], 1.0 + w.float()) for c in used) for w in weights)
        assert all(c[1].dtype == torch.float32 for c in used)
    else:
        assert {id(c[2]) for c in used} == set(norms)  # every norm, with its own weight
        assert {c[4] for c in used} == {"gemma"} and set(offsets) == {1.0}
