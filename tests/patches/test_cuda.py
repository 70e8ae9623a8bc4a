"""qwenkit.patches.cuda: liger-kernel's functions called with the right arguments (a double, no GPU
needed), HF's code without liger-kernel, and on a CUDA GPU the fused model against the unpatched one in bf16."""

from __future__ import annotations

import collections
import copy
import importlib.abc
import importlib.util
import sys

import pytest
import torch

from patches.doubles import (
    assert_bf16_parity,
    assert_bitwise,
    assert_close_run,
    fake_liger,
    layout,
    seeded_bf16,
    spy,
)
from qwenkit import patches
from qwenkit.bench.step import loss_and_grads
from qwenkit.patches import dispatch


def test_cuda_tensors_without_liger_run_the_original(make_model, batch_factory):
    if dispatch.installed("liger_kernel"):
        pytest.skip("liger-kernel is installed here; this checks the fallback without it")
    model = make_model(seed=0)
    batch = batch_factory()
    reference = loss_and_grads(model, batch)
    report = patches.apply(model, device_of=lambda t: "cuda")
    assert report.routes["cuda"] == "original (liger-kernel not installed)"
    assert_bitwise(loss_and_grads(model, batch), reference)


def test_cuda_route_calls_liger(make_model, batch_factory, monkeypatch):
    """Checks dispatch, not Liger numerics: a plain-torch double of Liger's functional API with
    Liger's tensor layouts; the glue around it must reproduce HF's loss and gradients."""
    calls = []
    for name, mod in fake_liger(calls).items():
        monkeypatch.setitem(sys.modules, name, mod)
    model = make_model(seed=0)
    batch = batch_factory()
    reference = loss_and_grads(model, batch)
    report = patches.apply(model, backend="cuda", device_of=lambda t: "cuda")
    assert report.routes == {
        "npu": "original (backend=cuda)",
        "cuda": "liger-kernel",
        "other devices": "original",
    }
    assert_close_run(loss_and_grads(model, batch), reference)
    n_text, n_vision = layout(model)
    counts = collections.Counter(c[0] for c in calls)
    assert counts == {
        "liger_rms_norm": 2 * n_text + 2 * n_vision + 2,
        "liger_rope": n_vision,
        "liger_swiglu": n_text,
    }
    assert all(c[4] == "llama" for c in calls if c[0] == "liger_rms_norm")


def _cuda_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("liger_kernel") is None:
        return "needs liger-kernel (pip install 'qwenkit[cuda]')"
    return None


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_missing() is not None, reason=str(_cuda_missing()))
def test_cuda_liger_bf16_chunk_loss_matches_unpatched(tiny_path, batch_factory, monkeypatch):
    import liger_kernel.transformers.functional as liger

    reference_model = seeded_bf16(tiny_path, "sdpa").to("cuda")
    fused_model = copy.deepcopy(reference_model)
    report = patches.apply(fused_model)
    assert report.routes["cuda"] == "liger-kernel"
    counts = spy(monkeypatch, liger, ["liger_rms_norm", "liger_rope", "liger_swiglu"])
    batch = {k: v.to("cuda") for k, v in batch_factory().items()}
    reference = loss_and_grads(reference_model, batch)
    fused = loss_and_grads(fused_model, batch)
    assert set(counts) == {"liger_rms_norm", "liger_rope", "liger_swiglu"}, counts
    assert_bf16_parity(fused, reference)
