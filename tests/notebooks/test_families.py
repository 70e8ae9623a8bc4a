"""The notebooks with the family as a parameter (``model_name``): notebook 03's chunk-vs-HF
comparison and notebook 04's fused-op report on each family's tiny model, through the notebooks'
own functions (the notebooks themselves run on Qwen2.5-VL in tests/test_notebooks.py)."""

from conftest import EVERY_FAMILY, over_families

from qwenkit import config as qconfig
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as families
from qwenkit.notebooks import perf, validation


def _cfg(family):
    return qconfig.load(overrides=["model.path=tiny", f"model.name={family}"])


@over_families("qwen3_5")  # the MoE variant's linear attention is the same layer (tests/model/families/test_chunked.py runs both)
def test_chunk_loss_equals_hfs_forward_on_the_hybrid_linear_attention_family(family):
    """Notebook 03 on Qwen3.5: the chunked head against HF's own forward, text and image batches,
    both loss types, a chunk that divides nothing (one above the sequence: test_validation), in fp32 at the
    tolerance of the hybrid families (validation.HYBRID_FP32: atol 1e-7 failed text/sample_mean/7
    by the Gated DeltaNet layers' rounding, 2.6e-7 in the embedding gradient)."""
    cases, per_param = validation.compare(_cfg(family), [7], batch_size=2)
    assert len(cases) == 2 * 2 and all((c["rtol"], c["atol"]) == validation.HYBRID_FP32 for c in cases)
    assert all(c["passed"] for c in cases), [c for c in cases if not c["passed"]]
    assert max(c["grad_max_abs_diff"] for c in cases) <= 1e-6 and max(c["loss_abs_diff"] for c in cases) <= 1e-5
    linear = {r["param"] for r in per_param if ".linear_attn." in r["param"]}
    assert linear, "the linear-attention layers' gradients are compared too"


@EVERY_FAMILY
def test_fused_ops_report_says_what_is_patched_and_what_stays_hfs(family, tmp_path):
    model = registry.build(_cfg(family).model, _cfg(family).loss)
    rows = perf.fused_ops_rows(model)
    status = {r["op"]: r["status"] for r in rows}
    fits = families.get(family).fused_ops
    for op in ("rms_norm", "vision_rope", "swiglu"):
        assert status[op].startswith("patched") == (op in fits), (op, status[op])
    assert status["text_mrope"].startswith("original")
    linear = [op for op in status if op.startswith("linear attention")]
    assert bool(linear) == ("linear_attention" in families.get(family).mixers)
    assert all(status[op].startswith("original") for op in linear)
    assert not any(hasattr(m, "_qwenkit_patch") for m in model.modules()), "the report leaves the model as it was"
    perf.write_fused_ops(tmp_path, rows, "cpu")
    drawn = perf.fused_ops_table(tmp_path).data[0].cells.values
    assert list(drawn[0]) == [r["op"] for r in rows] and list(drawn[2]) == [r["status"] for r in rows]


@over_families("qwen3_5")
def test_fused_timing_patches_only_the_ops_the_family_fits(family, monkeypatch):
    """Where fused kernels exist (CUDA with Liger, NPU), notebook 04 times the model patched as the
    trainer patches it: on Qwen3.5 asking for every op was refused (its RMSNorms scale by 1 + weight)."""
    model = registry.build(_cfg(family).model, _cfg(family).loss)
    monkeypatch.setattr(perf, "fused_available", lambda device: (True, "a kernel library"))
    monkeypatch.setattr(perf, "time_steps", lambda *a, **k: [1.0])
    out = perf.fused_vs_unfused(model, [], steps=1)
    assert out["active"] == list(families.get(family).fused_ops) == ["swiglu"]

