"""qwenkit.patches.install (``patches.apply``, ``patches.revert``): CPU fallback parity, idempotence, switches, revert.

The other modules' own files: dispatch, npu, cuda, kernels (their glue), report, targets.

References: the same tiny model unpatched (CPU fallback must be bit-identical), HF's own op
forwards (op-level glue), and on hardware the unpatched model in bf16 (``cuda`` / ``npu``).
"""

from __future__ import annotations

import copy
import sys

import pytest
from torch import nn

from patches.doubles import assert_bitwise, fake_torch_npu, layout, patched_modules
from qwenkit import patches
from qwenkit.bench.step import loss_and_grads

# ---------------------------------------------------------------------------------------------
# CPU: the fallback path is HF's code, bit for bit; revert restores the originals


def test_cpu_patched_model_is_bit_identical_and_revert_restores(make_model, batch_factory):
    model = make_model(seed=0)
    batch = batch_factory()
    reference = loss_and_grads(model, batch)

    report = patches.apply(model)
    n_text, n_vision = layout(model)
    assert report.op("rms_norm").where == {"text": 2 * n_text + 1, "vision": 2 * n_vision + 1}
    assert report.op("vision_rope").where == {"vision": n_vision}
    assert report.op("swiglu").where == {"text": n_text}
    assert (
        report.changed == len(patched_modules(model)) == 2 * n_text + 1 + 2 * n_vision + 1 + n_vision + n_text
    )
    assert report.active == list(patches.OPS)
    for m in patched_modules(model).values():
        assert m._qwenkit_original_forward.__func__ is type(m).forward

    assert_bitwise(loss_and_grads(model, batch), reference)

    assert patches.revert(model) == report.changed
    for m in model.modules():
        assert not {"forward", "_qwenkit_patch", "_qwenkit_original_forward"} & m.__dict__.keys()
    assert patches.revert(model) == 0
    assert_bitwise(loss_and_grads(model, batch), reference)


# ---------------------------------------------------------------------------------------------
# Idempotence, switches, errors


def test_apply_twice_is_a_no_op_and_says_so(make_model, monkeypatch):
    model = make_model()
    first = patches.apply(model)
    forwards = {name: m.__dict__["forward"] for name, m in patched_modules(model).items()}
    second = patches.apply(model)
    assert second.changed == 0
    assert [o.status for o in second.ops] == ["already patched"] * 3
    assert [o.matched for o in second.ops] == [o.modules for o in first.ops]
    assert "nothing changed (already patched)" in str(second)
    assert {name: m.__dict__["forward"] for name, m in patched_modules(model).items()} == forwards
    assert all(
        m._qwenkit_original_forward.__func__ is type(m).forward for m in patched_modules(model).values()
    )
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu([]))
    with pytest.raises(ValueError, match="already patched with backend='auto'"):
        patches.apply(model, backend="npu")


@pytest.mark.parametrize("env", patches.DISABLE_ENV)
def test_environment_switches_disable_everything(make_model, monkeypatch, env):
    for name in patches.DISABLE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(env, "0")
    assert patches.fused_enabled()
    monkeypatch.setenv(env, "1")
    assert not patches.fused_enabled()
    model = make_model()
    report = patches.apply(model)
    assert report.disabled_by == f"{env}=1" and report.changed == 0 and report.active == []
    assert patched_modules(model) == {}
    assert str(report).startswith(f"fused ops: off ({env}=1)")


def test_config_switch_off_and_subset(make_model, monkeypatch):
    for name in patches.DISABLE_ENV:
        monkeypatch.delenv(name, raising=False)
    model = make_model()
    off = patches.apply(model, ops="off")
    assert off.disabled_by == "model.fused_ops=off" and patched_modules(model) == {}

    subset = patches.apply(model, ops=["swiglu"])
    assert subset.active == ["swiglu"]
    assert [o.status for o in subset.ops] == ["off (not in model.fused_ops)"] * 2 + ["patched"]
    assert {n.rsplit(".", 1)[-1] for n in patched_modules(model)} == {"mlp"}

    with pytest.raises(ValueError, match="unknown fused op"):
        patches.apply(model, ops=["rms_norm", "layer_norm"])
    with pytest.raises(ValueError, match="backend must be one of"):
        patches.apply(model, backend="tpu")
    with pytest.raises(ValueError, match="needs torch_npu"):
        patches.apply(model, backend="npu")


def test_op_that_matches_nothing_is_an_error_and_changes_nothing(make_model):
    with pytest.raises(patches.PatchError, match="rms_norm .*vision_rope .*swiglu"):
        patches.apply(nn.Sequential(nn.Linear(4, 4)))

    model = make_model()
    for layer in model.model.language_model.layers:
        layer.mlp.act_fn = nn.GELU()  # no longer a SwiGLU: the swiglu patch must refuse
    with pytest.raises(patches.PatchError, match="swiglu") as err:
        patches.apply(model)
    assert "rms_norm" not in str(err.value)
    assert patched_modules(model) == {}  # all or nothing: the norms were not patched either


def test_deepcopy_of_a_patched_model_stays_bound_to_the_copy(make_model):
    model = make_model()
    patches.apply(model)
    clone = copy.deepcopy(model)
    for name, m in patched_modules(clone).items():
        assert m.forward.__self__ is m and m._qwenkit_original_forward.__self__ is m, name
    assert patches.revert(clone) == len(patched_modules(model))
