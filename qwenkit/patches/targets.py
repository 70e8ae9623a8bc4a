"""Which module instances each fused op replaces, found by structure rather than class name.

Class names move between transformers releases (the text RMSNorm is ``Qwen2RMSNorm`` in 4.57
and ``Qwen2_5_VLRMSNorm`` in 5.x); the module tree (``model.visual.blocks.{i}``,
``model.language_model.layers.{i}``) and the attributes the fused forwards use do not. A
matcher checks exactly the attributes its fused forward reads, so a match is always safe to
patch, and an op that matches nothing is reported as an error by ``apply``.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

TEXT, VISION = "language_model", "visual"  # module-path components of the two towers

LOOKED_FOR = {
    "rms_norm": "modules named *RMSNorm with a 1-D weight and variance_epsilon, or eps and a (1 + weight) scale "
    "(text and vision)",
    "vision_rope": f"*VisionAttention modules under {VISION!r}",
    "swiglu": f"MLPs under {TEXT!r} with gate_proj/up_proj/down_proj linears and a SiLU act_fn",
}


def _is_silu(act) -> bool:
    # ACT2FN["silu"] is HF's own SiLUActivation class in 4.57 and 5.x
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


# what HF's zero-centred RMSNorms (Qwen3.5's, Qwen4-Exp's, Gemma's) run: the norm in fp32, then times (1 + weight)
ZERO_CENTRED = ("self._norm(x.float())", "(1.0 + self.weight.float())")


@functools.cache
def zero_centred(cls: type) -> bool:
    """Whether an RMSNorm class scales by ``1 + weight`` in fp32 (its weight initialised at 0), read from its
    forward's source: no attribute says so, and a norm wrongly taken for one would be off by ``x / rms(x)``."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return all(piece in source for piece in ZERO_CENTRED)


def _is_rms_norm(parts: list[str], m: nn.Module) -> bool:
    weight = getattr(m, "weight", None)
    if not (type(m).__name__.endswith("RMSNorm") and isinstance(weight, nn.Parameter) and weight.dim() == 1):
        return False
    if hasattr(m, "variance_epsilon"):
        return True
    # Qwen4-Exp's norm over groups of the hyper-connection streams (group_size) scales each group by its own
    # slice of the weight: a 1-D kernel's one weight per column does not fit it, so HF's runs
    return isinstance(getattr(m, "eps", None), float) and getattr(m, "group_size", None) is None and zero_centred(type(m))


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
