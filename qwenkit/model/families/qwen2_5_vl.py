"""Qwen2.5-VL with the chunked loss head: HF's class plus :class:`~qwenkit.model.families.chunked.ChunkLossMixin`.

Nothing here is specific beyond the parent class and its output class; the family's module
paths and fused ops are its entry in :mod:`qwenkit.model.families.registry`, its tiny config in
:mod:`qwenkit.model.families.tiny_configs`.
"""

from __future__ import annotations

from transformers import Qwen2_5_VLForConditionalGeneration

try:  # the class HF's forward returns: transformers 5.x
    from transformers.modeling_outputs import MultimodalCausalLMOutputWithPast as CausalLMOutput
except ImportError:  # 4.57
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VLCausalLMOutputWithPast as CausalLMOutput,
    )

from qwenkit.model.families.chunked import ChunkedLMHead, ChunkLossMixin
from qwenkit.model.families.subclass import finish_subclass

__all__ = ["ChunkedLMHead", "QwenkitQwen2_5_VL"]


class QwenkitQwen2_5_VL(ChunkLossMixin, Qwen2_5_VLForConditionalGeneration):
    """Qwen2.5-VL whose training loss can be computed without full logits (``chunk_loss``)."""

    output_class = CausalLMOutput


finish_subclass(QwenkitQwen2_5_VL, Qwen2_5_VLForConditionalGeneration)
