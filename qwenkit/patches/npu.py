"""The three fused ops as torch_npu kernels (Ascend NPU).

``torch_npu`` is imported inside each function, i.e. only when :mod:`qwenkit.patches.dispatch`
has seen a tensor on an NPU; importing this module imports nothing. Each function takes the
arguments of the op it replaces and returns what HF's implementation returns.
"""

from __future__ import annotations

import torch

from qwenkit.config import FUSED_LIBRARIES

LIBRARY = FUSED_LIBRARIES["npu"]  # what must be importable for this route
KERNELS = {
    "rms_norm": "torch_npu.npu_rms_norm",
    "vision_rope": "torch_npu.npu_rotary_mul",
    "swiglu": "torch_npu.npu_swiglu",
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)``; the kernel returns ``(y, rstd)`` and keeps ``rstd`` for backward."""
    import torch_npu

    return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's zero-centred RMSNorm (Qwen3.5's, Qwen4-Exp's): the kernel's ``gamma`` is ``1 + weight``, and the
    norm runs in fp32 and is cast back last, as HF does (the gradient reaches ``weight`` through the sum)."""
    import torch_npu

    return torch_npu.npu_rms_norm(x.float(), 1.0 + weight.float(), epsilon=eps)[0].to(x.dtype)


def vision_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb_vision``: q, k ``[S, heads, D]``, cos, sin ``[S, D]``.

    ``npu_rotary_mul(x, r1, r2) = x * r1 + rotate_half(x) * r2`` wants 4-D ``[B, S, N, D]``
    input, so a batch dim of 1 is added. The math runs in fp32 and is cast back, as HF does.
    """
    import torch_npu

    r1 = cos.float()[None, :, None, :]  # [1, S, 1, D]
    r2 = sin.float()[None, :, None, :]
    q_out = torch_npu.npu_rotary_mul(q.float().unsqueeze(0), r1, r2)  # [1, S, heads, D]
    k_out = torch_npu.npu_rotary_mul(k.float().unsqueeze(0), r1, r2)
    return q_out[0].to(q.dtype), k_out[0].to(k.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``. ``npu_swiglu`` takes both halves in one tensor, hence the concat:
    one extra ``[..., 2 * intermediate]`` buffer, in exchange for not keeping ``silu(gate)``
    for backward. Fusing gate_proj and up_proj into one weight would avoid the concat but
    change HF's state-dict keys, which qwenkit keeps."""
    import torch_npu

    return torch_npu.npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)  # [..., 2I] -> [..., I]
