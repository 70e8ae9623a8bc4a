"""Fused-op patches: CPU fallback parity, dispatch through test doubles, switches, report, revert.

References: the same tiny model unpatched (CPU fallback must be bit-identical), HF's own op
forwards (op-level glue), and on hardware the unpatched model in bf16 (``cuda`` / ``npu``).
"""

from __future__ import annotations

import collections
import copy
import importlib.abc
import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import over_families
from torch import nn

from qwenkit import patches
from qwenkit.bench.step import loss_and_grads
from qwenkit.patches import cuda, dispatch, npu

# ---------------------------------------------------------------------------------------------
# Helpers


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


def test_cuda_tensors_without_liger_run_the_original(make_model, batch_factory):
    if dispatch.installed("liger_kernel"):
        pytest.skip("liger-kernel is installed here; this checks the fallback without it")
    model = make_model(seed=0)
    batch = batch_factory()
    reference = loss_and_grads(model, batch)
    report = patches.apply(model, device_of=lambda t: "cuda")
    assert report.routes["cuda"] == "original (liger-kernel not installed)"
    assert_bitwise(loss_and_grads(model, batch), reference)


# ---------------------------------------------------------------------------------------------
# NPU and CUDA routes without hardware: test doubles + a device predicate the test controls


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


# ---------------------------------------------------------------------------------------------
# Idempotence, switches, errors, report


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


def test_vision_rope_refuses_a_forward_that_no_longer_calls_it():
    with pytest.raises(patches.PatchError, match="does not call apply_rotary_pos_emb_vision"):
        dispatch.with_vision_rope(lambda self, x: x, dispatch.Router("auto"))


def test_deepcopy_of_a_patched_model_stays_bound_to_the_copy(make_model):
    model = make_model()
    patches.apply(model)
    clone = copy.deepcopy(model)
    for name, m in patched_modules(clone).items():
        assert m.forward.__self__ is m and m._qwenkit_original_forward.__self__ is m, name
    assert patches.revert(clone) == len(patched_modules(model))


def test_report_lists_ops_modules_and_routes(make_model):
    model = make_model()
    text = str(patches.apply(model))
    n_text, n_vision = layout(model)
    assert text.splitlines()[0] == f"fused ops: backend=auto, {3 * n_text + 3 * n_vision + 2} modules patched"
    for op, count in (
        ("rms_norm", 2 * n_text + 2 * n_vision + 2),
        ("vision_rope", n_vision),
        ("swiglu", n_text),
    ):
        assert any(line.split()[:3] == [op, str(count), "patched"] for line in text.splitlines()), op
    assert "text_mrope" in text and "routes by tensor device: npu -> " in text


# ---------------------------------------------------------------------------------------------
# On hardware (skipped without it): the real kernels against the unpatched model, in bf16


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.is_available()


def _seeded_bf16(tiny_path, attn: str):
    from qwenkit.model.qwen2_5_vl import QwenkitQwen2_5_VL

    model = QwenkitQwen2_5_VL.from_pretrained(
        tiny_path, dtype=torch.float32, attn_implementation=attn, local_files_only=True
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model.to(torch.bfloat16).configure_loss(chunk=True)


def _assert_bf16_parity(fused, reference):
    """bf16 keeps 8 mantissa bits (unit roundoff 3.9e-3); kernels and HF round at different
    points, so the loss may move by a few ulps and each gradient by ~1e-2 of its norm."""
    (loss_f, grads_f), (loss_r, grads_r) = fused, reference
    torch.testing.assert_close(loss_f.float(), loss_r.float(), rtol=2e-2, atol=2e-2)
    assert grads_f.keys() == grads_r.keys()
    for name in grads_r:
        g_f, g_r = grads_f[name].float(), grads_r[name].float()
        err = (g_f - g_r).norm() / g_r.norm().clamp_min(1e-12)
        assert err < 3e-2, f"{name}: relative gradient error {err:.3g}"


def _spy(monkeypatch, module, names) -> collections.Counter:
    counts = collections.Counter()
    for name in names:
        original = getattr(module, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return counts


@pytest.mark.npu
@pytest.mark.skipif(not _npu_available(), reason="needs an Ascend NPU with torch_npu")
def test_npu_bf16_flash_attention_chunk_loss_matches_unpatched(tiny_path, batch_factory, monkeypatch):
    import torch_npu

    reference_model = _seeded_bf16(tiny_path, "flash_attention_2").to("npu")
    fused_model = copy.deepcopy(reference_model)
    report = patches.apply(fused_model)
    assert report.routes["npu"] == "torch_npu"
    counts = _spy(monkeypatch, torch_npu, ["npu_rms_norm", "npu_rotary_mul", "npu_swiglu"])
    batch = {k: v.to("npu") for k, v in batch_factory().items()}
    reference = loss_and_grads(reference_model, batch)
    fused = loss_and_grads(fused_model, batch)
    assert set(counts) == {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu"}, counts
    _assert_bf16_parity(fused, reference)


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

    reference_model = _seeded_bf16(tiny_path, "sdpa").to("cuda")
    fused_model = copy.deepcopy(reference_model)
    report = patches.apply(fused_model)
    assert report.routes["cuda"] == "liger-kernel"
    counts = _spy(monkeypatch, liger, ["liger_rms_norm", "liger_rope", "liger_swiglu"])
    batch = {k: v.to("cuda") for k, v in batch_factory().items()}
    reference = loss_and_grads(reference_model, batch)
    fused = loss_and_grads(fused_model, batch)
    assert set(counts) == {"liger_rms_norm", "liger_rope", "liger_swiglu"}, counts
    _assert_bf16_parity(fused, reference)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"], indirect=True)
def test_qwen3_vl_patches_its_text_norms_and_reports_the_vision_path_unpatched(make_model, batch_factory, family):
    """Qwen3-VL: the text RMSNorms (q/k norms included) and, dense, the SwiGLU MLPs; its LayerNorm/GELU
    vision blocks are reported unpatched, and asking for vision_rope by name is refused."""
    from qwenkit.model import family as families

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
    from qwenkit.model import family as families

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
