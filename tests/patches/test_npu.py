"""qwenkit.patches.npu: torch_npu's kernels called with the right arguments (a double, no NPU needed),
and on an Ascend NPU the fused model against the unpatched one in bf16."""

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
    fake_torch_npu,
    layout,
    seeded_bf16,
    spy,
)
from qwenkit import patches
from qwenkit.bench.step import loss_and_grads


def test_npu_route_calls_torch_npu_with_the_right_arguments(make_model, batch_factory, monkeypatch):
    """Checks dispatch, not NPU numerics: a plain-torch double of torch_npu's three functions
    stands in for the library and a test-controlled predicate says which tensors are "on the
    NPU". It proves the routing is decided per call, that each kernel gets the arguments its
    contract asks for, and that the glue around it reproduces HF's loss and gradients."""
    calls = []
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(calls))
    on_npu = False
    model = make_model(seed=0)
    batch = batch_factory()
    reference = loss_and_grads(model, batch)

    report = patches.apply(model, device_of=lambda t: "npu" if on_npu else t.device.type)
    assert report.routes["npu"] == "torch_npu"
    assert_bitwise(loss_and_grads(model, batch), reference)  # still "on CPU": original ops
    assert calls == []

    on_npu = True  # the same model, now "moved": the next call takes the NPU route
    # fp32 on both sides; the doubles follow the kernel contracts' op order, so fp32 defaults hold
    assert_close_run(loss_and_grads(model, batch), reference)

    by_name = collections.defaultdict(list)
    for call in calls:
        by_name[call[0]].append(call[1:])
    n_text, n_vision = layout(model)

    norms = {id(m.weight): m for m in model.modules() if type(m).__name__.endswith("RMSNorm")}
    gammas = collections.Counter(id(gamma) for _, gamma, _ in by_name["npu_rms_norm"])
    assert gammas == collections.Counter(dict.fromkeys(norms, 1))  # every norm, once, with its own weight
    for x, gamma, eps in by_name["npu_rms_norm"]:
        assert eps == norms[id(gamma)].variance_epsilon
        assert x.shape[-1] == gamma.shape[0] and x.dtype == gamma.dtype

    vision_attn = model.model.visual.blocks[0].attn
    assert len(by_name["npu_rotary_mul"]) == 2 * n_vision  # q and k of every vision block
    for x, r1, r2 in by_name["npu_rotary_mul"]:
        seq, heads, dim = x.shape[1:]
        assert x.shape[0] == 1 and heads == vision_attn.num_heads and dim == vision_attn.head_dim
        assert r1.shape == r2.shape == (1, seq, 1, dim)
        assert x.dtype == r1.dtype == r2.dtype == torch.float32

    intermediate = model.model.language_model.layers[0].mlp.intermediate_size
    assert len(by_name["npu_swiglu"]) == n_text
    for x, dim in by_name["npu_swiglu"]:
        assert dim == -1 and x.shape[-1] == 2 * intermediate


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.is_available()


@pytest.mark.npu
@pytest.mark.skipif(not _npu_available(), reason="needs an Ascend NPU with torch_npu")
def test_npu_bf16_flash_attention_chunk_loss_matches_unpatched(tiny_path, batch_factory, monkeypatch):
    import torch_npu

    reference_model = seeded_bf16(tiny_path, "flash_attention_2").to("npu")
    fused_model = copy.deepcopy(reference_model)
    report = patches.apply(fused_model)
    assert report.routes["npu"] == "torch_npu"
    counts = spy(monkeypatch, torch_npu, ["npu_rms_norm", "npu_rotary_mul", "npu_swiglu"])
    batch = {k: v.to("npu") for k, v in batch_factory().items()}
    reference = loss_and_grads(reference_model, batch)
    fused = loss_and_grads(fused_model, batch)
    assert set(counts) == {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu"}, counts
    assert_bf16_parity(fused, reference)
