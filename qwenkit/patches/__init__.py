"""Fused-operator patches (RMSNorm, vision RoPE, SwiGLU); see qwenkit.patches.npu / cuda."""

OPS = ("rms_norm", "vision_rope", "swiglu")
