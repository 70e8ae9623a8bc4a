"""qwenkit.patches.targets: which modules of each family an op patches (Qwen2.5-VL's: tests/patches/test_report.py)."""

from __future__ import annotations

import pytest
from conftest import over_families

from patches.doubles import assert_bitwise
from qwenkit import patches
from qwenkit.bench.step import loss_and_grads


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"], indirect=True)
def test_qwen3_vl_patches_its_text_norms_and_reports_the_vision_path_unpatched(make_model, batch_factory, family):
    """Qwen3-VL: the text RMSNorms (q/k norms included) and, dense, the SwiGLU MLPs; its LayerNorm/GELU
    vision blocks are reported unpatched, and asking for vision_rope by name is refused."""
    from qwenkit.model.families import registry as families

    model = make_model(seed=0)
    batch = batch_factory()
    reference = loss_and_grads(model, batch)
    fits = families.get(family).fused_ops
    report = patches.apply(model, applicable=fits)
    layers = model.config.text_config.num_hidden_layers
    assert report.op("rms_norm").where == {"text": 4 * layers + 1}  # input, post-attention, q, k; final norm
    assert report.op("vision_rope").status.startswith("unpatched")
    assert (report.op("swiglu").where == {"text": layers}) == ("swiglu" in fits)
    assert_bitwise(loss_and_grads(model, batch), reference)
    patches.revert(model)
    with pytest.raises(patches.PatchError, match="do not fit"):
        patches.apply(model, ops=["vision_rope"], applicable=fits)


@over_families("qwen3_5", "qwen3_5_moe")
def test_qwen3_5_patches_swiglu_and_reports_its_norms_unpatched(make_model, batch_factory, family):
    """Qwen3.5: SwiGLU (every dense MLP; the MoE's shared expert) only. Its text RMSNorms scale by
    (1 + weight) and the linear attention's norm is gated: no kernel here computes either, so the
    matcher finds none, and asking for rms_norm by name is refused."""
    from qwenkit.model.families import registry as families

    model = make_model(seed=0)
    batch = batch_factory()
    reference = loss_and_grads(model, batch)
    fits = families.get(family).fused_ops
    report = patches.apply(model, applicable=fits)
    assert report.op("swiglu").where == {"text": model.config.text_config.num_hidden_layers}
    assert report.op("rms_norm").status.startswith("unpatched")
    assert_bitwise(loss_and_grads(model, batch), reference)
    patches.revert(model)
    with pytest.raises(patches.PatchError, match="do not fit"):
        patches.apply(model, ops=["rms_norm"], applicable=fits)
