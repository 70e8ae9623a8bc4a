"""Installing the routed forwards on a model's module instances (:func:`apply`) and taking them off (:func:`revert`).

See :mod:`qwenkit.patches` for what is patched and why; the switches (``QWENKIT_DISABLE_FUSED``,
``model.fused_ops``) are read here.
"""


from __future__ import annotations

import logging
import os
import types
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from qwenkit.config import FUSED_BACKENDS as BACKENDS
from qwenkit.config import FUSED_OPS as OPS
from qwenkit.config import fused_backend_problem, fused_ops_problems
from qwenkit.patches import dispatch, targets
from qwenkit.patches.dispatch import DeviceOf, Router
from qwenkit.patches.report import OpReport, PatchError, PatchReport

DISABLE_ENV = ("QWENKIT_DISABLE_FUSED", "QWEN25VL_DISABLE_NPU_FUSION")

log = logging.getLogger("qwenkit.patches")  # the package's logger, as before the move

_FORWARDS = {"rms_norm": dispatch.rms_norm_forward, "swiglu": dispatch.swiglu_forward}


@dataclass
class _Patch:
    """Stored on a patched module as ``_qwenkit_patch``."""

    op: str
    router: Router
    shadowed: bool  # the instance had its own ``forward`` before: revert puts it back as it was


def disabled_by() -> str | None:
    """The environment switch that disables fused ops (``"NAME=value"``), or None."""
    for name in DISABLE_ENV:
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{name}={os.environ[name]}"
    return None


def fused_enabled() -> bool:
    """False when ``QWENKIT_DISABLE_FUSED`` or ``QWEN25VL_DISABLE_NPU_FUSION`` is set to 1/true/yes/on."""
    return disabled_by() is None


def _wanted(ops: str | Sequence[str]) -> tuple[str, ...]:
    if ops == "auto":
        return OPS
    if ops == "off":
        return ()
    problems = fused_ops_problems(ops)
    if problems:
        raise ValueError("; ".join(problems))
    return tuple(o for o in OPS if o in ops)


def apply(
    model: nn.Module,
    backend: str = "auto",
    ops: str | Sequence[str] = "auto",
    device_of: DeviceOf | None = None,
    applicable: Sequence[str] | None = None,
) -> PatchReport:
    """Patch ``model``'s RMSNorm, vision-RoPE and text-MLP instances; return and log the report.

    ``backend``: ``"auto"`` (NPU tensors -> torch_npu, CUDA tensors -> Liger if installed),
    ``"npu"`` or ``"cuda"`` (only that route; its library must be installed). ``ops``: the
    value of ``model.fused_ops``. ``device_of``: the per-call device predicate (tests inject
    one; the default reads ``tensor.device.type``). ``applicable``: the ops that fit the model's
    family (its entry's ``fused_ops``; None: all): ``auto`` patches those and reports the others
    as left unpatched, a list naming another is refused. All-or-nothing: every requested op must
    match at least one module (else :class:`PatchError`) before any module is changed.
    """
    if backend not in BACKENDS:
        raise ValueError(fused_backend_problem(backend))
    wanted = _wanted(ops)
    reason = disabled_by() or (None if wanted else f"model.fused_ops={ops}")
    routes = dispatch.routes(backend)
    if reason:
        report = PatchReport(
            backend, routes, [OpReport(op, f"off ({reason})") for op in OPS], disabled_by=reason
        )
        log.info("%s", report)
        return report
    problem = fused_backend_problem(backend)
    if problem:
        raise ValueError(problem)

    unfit = [op for op in OPS if applicable is not None and op not in applicable]
    if ops != "auto" and (asked := [op for op in wanted if op in unfit]):
        raise PatchError(
            f"fused op(s) {asked} do not fit {type(model).__name__} (its family patches {list(applicable)}); "
            "leave them out of model.fused_ops"
        )
    wanted = tuple(op for op in wanted if op not in unfit)
    router = Router(backend, device_of)
    found = {op: targets.find(model, op) for op in wanted}
    empty = [op for op in wanted if not found[op]]
    if empty:
        raise PatchError(
            f"fused op(s) matched no module in {type(model).__name__}: "
            + "; ".join(f"{op} (looked for {targets.LOOKED_FOR[op]})" for op in empty)
            + ". Leave them out of model.fused_ops, or fix the model."
        )
    installs, reports = [], []
    routed_vision = {}  # one routed vision-attention forward per HF function, shared by its instances
    for op in OPS:
        if op in unfit:
            reports.append(OpReport(op, f"unpatched (does not fit {type(model).__name__})"))
            continue
        if op not in wanted:
            reports.append(OpReport(op, "off (not in model.fused_ops)"))
            continue
        rep = OpReport(op, "patched")
        for name, m in found[op]:
            tower = targets.tower(name)
            rep.where[tower] = rep.where.get(tower, 0) + 1
            patch = m.__dict__.get("_qwenkit_patch")
            if patch is not None:
                if patch.router.backend != backend:
                    raise ValueError(
                        f"{name} is already patched with backend={patch.router.backend!r}; revert() before "
                        f"applying backend={backend!r}"
                    )
                rep.already += 1
                continue
            if op == "vision_rope":
                fn = getattr(m.forward, "__func__", m.forward)
                if fn not in routed_vision:
                    routed_vision[fn] = dispatch.with_vision_rope(fn, router)
                forward = routed_vision[fn]
            else:
                forward = _FORWARDS[op]
            installs.append((m, _Patch(op, router, shadowed="forward" in m.__dict__), forward))
            rep.modules += 1
        if rep.modules == 0:
            rep.status = "already patched"
        reports.append(rep)
    for m, patch, forward in installs:
        m._qwenkit_original_forward = m.forward
        m._qwenkit_patch = patch
        m.forward = types.MethodType(forward, m)
    report = PatchReport(backend, routes, reports)
    log.info("%s", report)
    return report


def revert(model: nn.Module) -> int:
    """Restore every patched module's original forward; returns how many were restored."""
    restored = 0
    for _, m in model.named_modules():
        patch = m.__dict__.pop("_qwenkit_patch", None)
        if patch is None:
            continue
        original = m.__dict__.pop("_qwenkit_original_forward")
        if patch.shadowed:
            m.forward = original
        else:
            del m.__dict__["forward"]  # the class's forward shows through again
        restored += 1
    if restored:
        log.info("fused ops: reverted %d modules", restored)
    return restored
