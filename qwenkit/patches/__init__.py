"""Fused-operator patches for every family: RMSNorm, vision RoPE, and the text SwiGLU MLP.

Which ops fit a family's modules (Qwen2.5-VL, Qwen3-VL and Qwen3.5, dense and MoE) is its entry's
``fused_ops`` (:mod:`qwenkit.model.families.registry`); the caller passes them to :func:`apply` as ``applicable``.

:func:`apply` replaces the ``forward`` of matching module *instances* of one model (never a
transformers class, so other models in the process are untouched) with one that picks, at
every call and from the input tensor's device, what runs (:mod:`qwenkit.patches.dispatch`):
torch_npu kernels on NPU tensors (:mod:`~qwenkit.patches.npu`), Liger-Kernel on CUDA tensors
when liger-kernel is installed (:mod:`~qwenkit.patches.cuda`), HF's own forward otherwise.

Text mRoPE stays HF's implementation, as in the original NPU integration: its cos/sin are
assembled per mRoPE section (inside ``apply_multimodal_rotary_pos_emb`` in 4.57, in the
rotary-embedding module in 5.x), so one patch could not serve both transformers versions.

Reversible and observable: each patched module keeps its original bound forward in
``module._qwenkit_original_forward``; :func:`apply` returns (and logs) a :class:`PatchReport`;
a second call patches nothing and says so; :func:`revert` restores the originals. Switches:
``QWENKIT_DISABLE_FUSED=1`` (or ``QWEN25VL_DISABLE_NPU_FUSION=1``, the original integration's
name) and ``model.fused_ops: auto | off | [ops]``.

Modules: :mod:`.install` (``apply``, ``revert``, the switches), :mod:`.dispatch` (the per-call
route), :mod:`.targets` (which modules each op patches), :mod:`.npu` and :mod:`.cuda` (the
kernels' calls), :mod:`.report` (``PatchReport``).
"""
from __future__ import annotations

from qwenkit.patches.install import BACKENDS, DISABLE_ENV, OPS, apply, disabled_by, fused_enabled, revert
from qwenkit.patches.report import OpReport, PatchError, PatchReport

__all__ = ["BACKENDS", "DISABLE_ENV", "OPS", "OpReport", "PatchError", "PatchReport", "apply", "disabled_by",
           "fused_enabled", "revert"]  # fmt: skip
