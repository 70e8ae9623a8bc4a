"""Test doubles of torch_npu and liger-kernel (plain torch, every call recorded), and the comparisons the
patch tests make: bit for bit on CPU, bf16 parity on hardware."""

from __future__ import annotations

import collections
import types

import torch
import torch.nn.functional as F


def assert_bitwise(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


def assert_close_run(a, b, **tol):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    torch.testing.assert_close(loss_a, loss_b, **tol)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def layout(model):
    """(text decoder layers, vision blocks) of a Qwen2.5-VL model."""
    return len(model.model.language_model.layers), len(model.model.visual.blocks)


def patched_modules(model):
    return {name: m for name, m in model.named_modules() if "_qwenkit_patch" in m.__dict__}


def fake_torch_npu(calls: list) -> types.ModuleType:
    """Plain-torch stand-ins with torch_npu's signatures; every call is recorded in ``calls``."""

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        calls.append(("npu_rms_norm", x, gamma, epsilon))
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return gamma * (xf * rstd).to(x.dtype), rstd

    def npu_rotary_mul(x, r1, r2):
        calls.append(("npu_rotary_mul", x, r1, r2))
        x1, x2 = x.chunk(2, dim=-1)
        return x * r1 + torch.cat((-x2, x1), dim=-1) * r2

    def npu_swiglu(x, dim=-1):
        calls.append(("npu_swiglu", x, dim))
        a, b = x.chunk(2, dim=dim)
        return F.silu(a) * b

    mod = types.ModuleType("torch_npu")
    mod.npu_rms_norm, mod.npu_rotary_mul, mod.npu_swiglu = npu_rms_norm, npu_rotary_mul, npu_swiglu
    return mod


def fake_liger(calls: list) -> dict[str, types.ModuleType]:
    """Plain-torch stand-ins for ``liger_kernel.transformers.functional`` (Liger's layouts)."""

    def liger_rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
        calls.append(("liger_rms_norm", X, W, eps, casting_mode))
        xf = X.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (W + offset) * (xf * rstd).to(X.dtype)

    def liger_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        calls.append(("liger_rope", q, k, cos, sin))  # q, k [B, heads, S, D]; cos, sin [1, S, D]
        c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

        def rot(x):
            x = x.to(cos.dtype)
            x1, x2 = x.chunk(2, dim=-1)
            return (x * c + torch.cat((-x2, x1), dim=-1) * s).to(q.dtype)

        return rot(q), rot(k), cos, sin  # newer Liger returns cos and sin too

    def liger_swiglu(a, b):
        calls.append(("liger_swiglu", a, b))
        return F.silu(a) * b

    root, tf, fn = (
        types.ModuleType(n)
        for n in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.functional")
    )
    fn.liger_rms_norm, fn.liger_rope, fn.liger_swiglu = liger_rms_norm, liger_rope, liger_swiglu
    root.transformers, tf.functional = tf, fn
    return {m.__name__: m for m in (root, tf, fn)}


def seeded_bf16(tiny_path, attn: str):
    from qwenkit.model.families.qwen2_5_vl import QwenkitQwen2_5_VL

    model = QwenkitQwen2_5_VL.from_pretrained(
        tiny_path, dtype=torch.float32, attn_implementation=attn, local_files_only=True
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.to(torch.bfloat16).configure_loss(chunk=True)


def assert_bf16_parity(fused, reference):
    """bf16 keeps 8 mantissa bits (unit roundoff 3.9e-3); kernels and HF round at different
    points, so the loss may move by a few ulps and each gradient by ~1e-2 of its norm."""
    (loss_f, grads_f), (loss_r, grads_r) = fused, reference
    torch.testing.assert_close(loss_f.float(), loss_r.float(), rtol=2e-2, atol=2e-2)
    assert grads_f.keys() == grads_r.keys()
    for name in grads_r:
        g_f, g_r = grads_f[name].float(), grads_r[name].float()
        err = (g_f - g_r).norm() / g_r.norm().clamp_min(1e-12)
        assert err < 3e-2, f"{name}: relative gradient error {err:.3g}"


def spy(monkeypatch, module, names) -> collections.Counter:
    counts = collections.Counter()
    for name in names:
        original = getattr(module, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return counts
