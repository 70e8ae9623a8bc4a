"""The chunk-vs-full comparison notebook 03 shows: it passes on the kit's head and would catch a wrong one."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qwenkit import config as qconfig
from qwenkit.bench import step
from qwenkit.model.families import build as registry
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX, shift_labels
from qwenkit.model.paths import load_processor
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


def _fp64_reference_curve(cfg, steps, lr, batch_size, num_batches, seed=42):
    """The same AdamW run in float64 with a float64 loss: the trajectory without fp32 rounding.

    HF's head (and the chunked one) compute the loss in fp32 whatever the weights' dtype, so the
    reference takes the logits and applies a float64 cross-entropy here.
    """
    processor = load_processor(cfg)
    batches = validation.validation_batches(cfg, processor, "image-text", num_batches, batch_size)
    batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in batches]
    torch.manual_seed(seed)
    model = registry.build(cfg.model, cfg.loss).double()
    model.configure_loss(chunk=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for i in range(steps):
        batch = dict(batches[i % len(batches)])
        labels = batch.pop("labels")
        opt.zero_grad(set_to_none=True)
        logits = model(**batch).logits  # [B, S, V] float64
        loss = F.cross_entropy(logits.flatten(0, 1), shift_labels(labels).flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_adamw_curves_agree_and_learn(tiny_path):
    """Both fp32 curves track the fp64 trajectory, the chunked one as closely as the full head does.

    Six fp32 Adam steps amplify the heads' ~1e-7 gradient rounding differences (another
    summation order, another CPU's kernels) into loss differences of ~1e-5, more on some CPUs:
    no absolute bound fits every machine. The scale is measured instead: the full head's own
    distance from the fp64 run, so far (``full_err``). The chunked head must stay within 4x that,
    plus 4 fp32 ulps of the loss (the forward's rounding, which the first steps show alone).
    A 1e-3 error in the token weights of every chunk but the first puts the chunked curve 1000x
    further off (3.8e-3 at step 1).
    """
    cfg = qconfig.load()
    kw = dict(steps=6, lr=5e-3, batch_size=2, num_batches=1)
    rows = validation.adamw_curves(cfg, chunk_size=4, **kw)  # several chunks over the batch's labelled rows
    diff = validation.curve_difference(rows)
    assert [d["step"] for d in diff] == list(range(1, 7))
    full = [r["loss"] for r in rows if r["mode"] == "full"]
    chunk = [r["loss"] for r in rows if r["mode"] == "chunk"]
    exact = _fp64_reference_curve(cfg, **kw)
    full_err = 0.0
    for n, (f, c, e) in enumerate(zip(full, chunk, exact), start=1):
        full_err = max(full_err, abs(f - e))
        ulp = float(np.spacing(np.float32(e)))  # one fp32 ulp of the loss
        assert abs(c - e) <= 4 * full_err + 4 * ulp, (n, c - e, f - e)
        assert abs(f - e) <= 1e-4 * abs(e), (n, f, e)  # fp32 itself tracks the exact run
    assert full[-1] < full[0]
