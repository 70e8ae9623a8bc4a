"""The chunk-vs-full comparison notebook 03 shows: it passes on the kit's head and would catch a wrong one."""

import pytest
import torch

from qwenkit import config as qconfig
from qwenkit.bench import step
from qwenkit.notebooks import validation


def test_diff_flags_what_assert_close_would():
    ref = torch.tensor([1.0, -2.0, 0.0])
    assert validation.Diff.of(ref.clone(), ref, 1e-5, 1e-7).ok
    d = validation.Diff.of(ref + torch.tensor([0.0, 1e-3, 0.0]), ref, 1e-5, 1e-7)
    assert not d.ok
    assert d.max_abs == pytest.approx(1e-3, rel=1e-4) and d.max_rel == pytest.approx(5e-4, rel=1e-4)


def test_text_only_removes_vision_spans(processor):
    vs, pad, ve = processor.vision_start_id, processor.image_token_id, processor.vision_end_id
    sample = {
        "input_ids": torch.tensor([5, vs, pad, pad, ve, 6, 7]),
        "labels": torch.tensor([-100, -100, -100, -100, -100, 6, 7]),
        "pixel_values": torch.zeros(16, 1176),
    }
    out = step.text_only(sample, processor)
    assert out["input_ids"].tolist() == [5, 6, 7] and out["labels"].tolist() == [-100, 6, 7]
    assert "pixel_values" not in out


def test_compare_passes_on_both_modalities(tiny_path):
    cfg = qconfig.load()
    cases, per_param = validation.compare(cfg, [5, 4096], loss_types=["token_mean"], batch_size=2)
    assert [(c["modality"], c["chunk_size"]) for c in cases] == [
        ("text", 5), ("text", 4096), ("image-text", 5), ("image-text", 4096)
    ]
    assert all(c["passed"] for c in cases), cases
    assert all(c["grad_max_abs_diff"] <= 1e-6 and c["loss_abs_diff"] <= 1e-5 for c in cases)
    vision = {r["param"] for r in per_param if r["modality"] == "image-text" and r["param"].startswith("model.visual")}
    assert vision, "image-text batches must give the vision tower gradients to compare"
    assert not any(r["param"].startswith("model.visual") for r in per_param if r["modality"] == "text")


def test_adamw_curves_agree_and_learn(tiny_path):
    cfg = qconfig.load()
    rows = validation.adamw_curves(cfg, chunk_size=16, steps=6, lr=5e-3, batch_size=2, num_batches=1)
    diff = validation.curve_difference(rows)
    assert [d["step"] for d in diff] == list(range(1, 7))
    assert max(abs(d["diff"]) for d in diff) <= 1e-5
    full = [r["loss"] for r in rows if r["mode"] == "full"]
    assert full[-1] < full[0]
