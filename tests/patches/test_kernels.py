"""Each device's kernel glue (qwenkit.patches.npu, qwenkit.patches.cuda) against HF's own ops, at op
level on odd shapes, through the test doubles: outputs and input/weight gradients."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from patches.doubles import fake_liger, fake_torch_npu
from qwenkit.patches import cuda, npu


@pytest.mark.parametrize("kernels", [npu, cuda], ids=["npu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_glue_matches_hf_ops(kernels, dtype, monkeypatch):
    """Op level, odd shapes, through the doubles (glue, not kernel numerics): each kernels
    function must give HF's output and input/weight gradients."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    calls = []
    fakes = {"torch_npu": fake_torch_npu(calls)} if kernels is npu else fake_liger(calls)
    for name, mod in fakes.items():
        monkeypatch.setitem(sys.modules, name, mod)
    g = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_()

    def run(fn, *inputs):
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        sum((o.float() * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
        grads = [i.grad.clone() for i in inputs]
        for i in inputs:
            i.grad = None
        return outs, grads

    def compare(fused, original, *inputs):
        (out_f, grad_f), (out_o, grad_o) = run(fused, *inputs), run(original, *inputs)
        for a, b in zip(out_f + tuple(grad_f), out_o + tuple(grad_o)):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b)  # dtype defaults: the doubles round where the kernels do

    norm = (getattr(hf, "Qwen2_5_VLRMSNorm", None) or hf.Qwen2RMSNorm)(40, eps=1e-5)  # 5.x / 4.57 name
    compare(
        lambda x, w: kernels.rms_norm(x, w, 1e-5),
        lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,)),
        leaf(3, 5, 40),
        leaf(40),
    )

    seq, heads, dim = 7, 3, 10
    qkv = leaf(seq, 3 * heads * dim)
    half = torch.randn(seq, dim // 2, generator=g)
    cos, sin = torch.cat([half.cos(), half.cos()], -1), torch.cat([half.sin(), half.sin()], -1)

    def split(fn):  # q, k as HF's vision attention makes them: non-contiguous views of one qkv
        def call(qkv):
            q, k, _ = qkv.reshape(seq, 3, heads, dim).permute(1, 0, 2, 3).unbind(0)
            return fn(q, k, cos, sin)

        return call

    compare(split(kernels.vision_rope), split(hf.apply_rotary_pos_emb_vision), qkv)
    compare(kernels.swiglu, lambda a, b: F.silu(a) * b, leaf(2, 3, 24), leaf(2, 3, 24))
    assert calls  # the doubles ran
