"""Qwen3.5 (dense and MoE) with the chunked loss head.

transformers 5.x only (4.57 has no Qwen3.5: the family entry says so before any rank starts).
The backbone runs as HF runs it: three of every four decoder layers are Gated DeltaNet linear
attention (a causal depthwise conv1d and a recurrent state along the sequence), the fourth gated
full attention; the vision tower is Qwen3-VL's without DeepStack, so the shared
:meth:`~qwenkit.model.families.chunked.ChunkLossMixin.vision_tower` serves as is. What differs:

- packed rows: the linear-attention layers must restart their conv window and recurrent state at
  every sample; :meth:`_packed_inputs` hands the sample boundaries to them as HF's own
  ``cu_seq_lens_q`` keyword, which :mod:`qwenkit.model.families.linear_attention` reads (HF's PyTorch
  fallback refuses it, so a run without that path fails instead of mixing samples); under
  sequence parallelism the same module exchanges heads for the sequence around those layers;
- MoE: the router's loss (the shared expert joins every token's output, not the balancing) as
  HF's forward adds it (:class:`qwenkit.model.families.qwen3_vl.RouterAuxLoss`).
"""

from __future__ import annotations

from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe

try:  # HF's output class of the dense forward: transformers 5.24 shares one; 5.19 (the vLLM environment's) has its own
    from transformers.modeling_outputs import MultimodalCausalLMOutputWithPast
except ImportError:
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5CausalLMOutputWithPast as MultimodalCausalLMOutputWithPast,
    )

from qwenkit.model.families import linear_attention
from qwenkit.model.families.chunked import ChunkLossMixin
from qwenkit.model.families.qwen3_vl import RouterAuxLoss
from qwenkit.model.families.subclass import finish_subclass


class _Packed:
    """Packed rows of the hybrid decoder: positions per sample, and the boundaries for the linear layers."""

    def __init__(self, config):
        super().__init__(config)
        linear_attention.install()  # once per process: HF's module functions that keep samples apart

    def _packed_inputs(self, input_ids, packed_seq_lens, use_cache, kwargs) -> bool:
        use_cache = super()._packed_inputs(input_ids, packed_seq_lens, use_cache, kwargs)
        kwargs.update(linear_attention.boundaries(packed_seq_lens, input_ids.device))
        return use_cache


class QwenkitQwen3_5(_Packed, ChunkLossMixin, Qwen3_5ForConditionalGeneration):
    """Qwen3.5 (dense) whose training loss can be computed without full logits (``chunk_loss``)."""

    output_class = MultimodalCausalLMOutputWithPast


class QwenkitQwen3_5Moe(_Packed, RouterAuxLoss, ChunkLossMixin, Qwen3_5MoeForConditionalGeneration):
    """Qwen3.5-MoE: the chunked head plus the router's auxiliary loss, as HF's forward adds it."""

    output_class = hf_moe.Qwen3_5MoeCausalLMOutputWithPast
    balancing_loss = staticmethod(hf_moe.load_balancing_loss_func)


finish_subclass(QwenkitQwen3_5, Qwen3_5ForConditionalGeneration)
finish_subclass(QwenkitQwen3_5Moe, Qwen3_5MoeForConditionalGeneration)
