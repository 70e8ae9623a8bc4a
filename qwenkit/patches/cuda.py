"""The three fused ops as Liger-Kernel Triton kernels (CUDA; ``pip install qwenkit[cuda]``).

``liger_kernel`` is imported inside each function, i.e. only when
:mod:`qwenkit.patches.dispatch` has seen a CUDA tensor and found liger-kernel installed.
Liger's functional API (``liger_kernel.transformers.functional``) is used rather than its
module classes or its ``monkey_patch``, so nothing in transformers is replaced globally.
"""

from __future__ import annotations

import torch

from qwenkit.config import FUSED_LIBRARIES

LIBRARY = FUSED_LIBRARIES["cuda"]  # what must be importable for this route
KERNELS = {
    "rms_norm": "liger_rms_norm",
    "vision_rope": "liger_rope",
    "swiglu": "liger_swiglu",
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``casting_mode="llama"`` is HF's Qwen2 order: rstd in fp32, cast to the input dtype, then
    times the weight. Liger's default ``in_place=True`` (dX written over dY) is what its own
    Qwen2-VL patch uses."""
    from liger_kernel.transformers.functional import liger_rms_norm

    return liger_rms_norm(x, weight, eps, offset=0.0, casting_mode="llama")


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's zero-centred RMSNorm (Qwen3.5's, Qwen4-Exp's): ``offset=1.0`` scales by ``1 + weight``, and
    ``casting_mode="gemma"`` is its order: x, weight and the product in fp32, cast to the input dtype last."""
    from liger_kernel.transformers.functional import liger_rms_norm

    return liger_rms_norm(x, weight, eps, offset=1.0, casting_mode="gemma")


def vision_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb_vision``: q, k ``[S, heads, D]``, cos, sin ``[S, D]``.

    Liger's rope takes q, k as ``[B, heads, S, D]`` and cos, sin as ``[1, S, D]``, and reads
    only the first half of cos/sin: right for the vision tower, whose cos/sin are
    ``cat([f, f])`` in both transformers 4.57 and 5.x. The kernel computes in the dtype of
    cos (fp32 here, as HF) and stores in the dtype of q. Newer Liger returns
    ``(q, k, cos, sin)``, older ``(q, k)``: only the first two are used.
    """
    from liger_kernel.transformers.functional import liger_rope

    out = liger_rope(
        q.unsqueeze(0).transpose(1, 2),  # [1, heads, S, D]
        k.unsqueeze(0).transpose(1, 2),
        cos.float().unsqueeze(0).contiguous(),  # [1, S, D]
        sin.float().unsqueeze(0).contiguous(),
    )
    return out[0].transpose(1, 2)[0], out[1].transpose(1, 2)[0]  # [S, heads, D]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel; silu(gate) is recomputed in backward, not stored."""
    from liger_kernel.transformers.functional import liger_swiglu

    return liger_swiglu(gate, up)
