"""qwenkit.patches.report: what the run log lists: each op, the modules it patched, the routes."""

from __future__ import annotations

from patches.doubles import layout
from qwenkit import patches


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
