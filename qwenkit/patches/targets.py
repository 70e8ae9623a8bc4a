"""Which module instances each fused op replaces, found by structure rather than class name.

Class names move between transformers releases (the text RMSNorm is ``Qwen2RMSNorm`` in 4.57
and ``Qwen2_5_VLRMSNorm`` in 5.x); the module tree (``model.visual.blocks.{i}``,
``model.language_model.layers.{i}``) and the attributes the fused forwards use do not. A
matcher checks exactly the attributes its fused forward reads, so a match is always safe to
patch, and an op that matches nothing is reported as an error by ``apply``.
"""

from __future__ import annotations

from torch import nn

TEXT, VISION = "language_model", "visual"  # module-path components of the two towers

LOOKED_FOR = {
    "rms_norm": "modules named *RMSNorm with a 1-D weight and variance_epsilon (text and vision)",
    "vision_rope": f"*VisionAttention modules under {VISION!r}",
    "swiglu": f"MLPs under {TEXT!r} with gate_proj/up_proj/down_proj linears and a SiLU act_fn",
}


def _is_silu(act) -> bool:
    # ACT2FN["silu"] is HF's own SiLUActivation class in 4.57 and 5.x
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _is_rms_norm(parts: list[str], m: nn.Module) -> bool:
    weight = getattr(m, "weight", None)
    return (
        type(m).__name__.endswith("RMSNorm")
        and hasattr(m, "variance_epsilon")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
    )


def _is_vision_attention(parts: list[str], m: nn.Module) -> bool:
    return VISION in parts and type(m).__name__.endswith("VisionAttention")


def _is_text_swiglu(parts: list[str], m: nn.Module) -> bool:
    return (
        TEXT in parts
        and all(isinstance(getattr(m, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj"))
        and _is_silu(getattr(m, "act_fn", None))
    )


MATCHERS = {"rms_norm": _is_rms_norm, "vision_rope": _is_vision_attention, "swiglu": _is_text_swiglu}


def find(model: nn.Module, op: str) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every instance ``op`` replaces, in module order."""
    match = MATCHERS[op]
    return [(name, m) for name, m in model.named_modules() if match(name.split("."), m)]


def tower(name: str) -> str:
    """``"text"``, ``"vision"`` or ``"other"``: where a module sits, for the report."""
    parts = name.split(".")
    return "vision" if VISION in parts else "text" if TEXT in parts else "other"
