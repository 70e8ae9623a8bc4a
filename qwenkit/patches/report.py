"""What ``patches.apply`` did: per op, its status and the modules it touched; routes per device.

``str(report)`` is the table written to the run log at start-up, e.g.::

    fused ops: backend=auto, 14 modules patched
      op           modules  status           where
      rms_norm          10  patched          text 5, vision 5
      vision_rope        2  patched          vision 2
      swiglu             2  patched          text 2
      text_mrope         -  original         HF's implementation, never fused
      routes by tensor device: npu -> torch_npu; cuda -> original (liger-kernel not installed); ...
"""

from __future__ import annotations

from dataclasses import dataclass, field


class PatchError(RuntimeError):
    """A requested fused op cannot be applied: it matched no module, or HF's code changed shape."""


@dataclass
class OpReport:
    op: str
    status: str  # "patched", "already patched", or "off (<reason>)"
    modules: int = 0  # modules this call patched
    already: int = 0  # modules found already patched and left as they were
    where: dict[str, int] = field(default_factory=dict)  # "text" / "vision" -> modules matched

    @property
    def matched(self) -> int:
        return self.modules + self.already


@dataclass
class PatchReport:
    backend: str  # "auto", "npu" or "cuda"
    routes: dict[str, str]  # tensor device -> what runs there ("torch_npu", "liger-kernel", "original (...)")
    ops: list[OpReport]
    disabled_by: str | None = None  # "QWENKIT_DISABLE_FUSED=1", "model.fused_ops=off", ...

    @property
    def changed(self) -> int:
        """Modules patched by this call (0 on a repeated call)."""
        return sum(o.modules for o in self.ops)

    @property
    def active(self) -> list[str]:
        """Ops whose patch is in place after this call."""
        return [o.op for o in self.ops if o.matched]

    def op(self, name: str) -> OpReport:
        return next(o for o in self.ops if o.op == name)

    def __str__(self) -> str:
        if self.disabled_by:
            head = f"fused ops: off ({self.disabled_by})"
        elif self.changed:
            head = f"fused ops: backend={self.backend}, {self.changed} modules patched"
        else:
            head = f"fused ops: backend={self.backend}, nothing changed (already patched)"
        lines = [head, f"  {'op':<12}{'modules':>8}  {'status':<24} where"]
        for o in self.ops:
            where = ", ".join(f"{k} {v}" for k, v in sorted(o.where.items()))
            lines.append(f"  {o.op:<12}{o.matched:>8}  {o.status:<24} {where}")
        lines.append(f"  {'text_mrope':<12}{'-':>8}  {'original':<24} HF's implementation, never fused")
        lines.append("  routes by tensor device: " + "; ".join(f"{d} -> {r}" for d, r in self.routes.items()))
        return "\n".join(lines)
