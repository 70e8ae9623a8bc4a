"""Qwen2.5-VL with the chunked loss head: HF's class plus :class:`~qwenkit.model.families.chunked.ChunkLossMixin`.

Nothing here is specific beyond the parent class and its output class; the family's module
paths and fused ops are its entry in :mod:`qwenkit.model.families.registry`; its tiny config closes the module.
"""

from __future__ import annotations

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

try:  # the class HF's forward returns: transformers 5.x
    from transformers.modeling_outputs import MultimodalCausalLMOutputWithPast as CausalLMOutput
except ImportError:  # 4.57
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VLCausalLMOutputWithPast as CausalLMOutput,
    )

from qwenkit.model.families.chunked import ChunkedLMHead, ChunkLossMixin
from qwenkit.model.families.subclass import finish_subclass
from qwenkit.model.tiny.configs import toy_parts

__all__ = ["ChunkedLMHead", "QwenkitQwen2_5_VL"]


class QwenkitQwen2_5_VL(ChunkLossMixin, Qwen2_5_VLForConditionalGeneration):
    """Qwen2.5-VL whose training loss can be computed without full logits (``chunk_loss``)."""

    output_class = CausalLMOutput


finish_subclass(QwenkitQwen2_5_VL, Qwen2_5_VLForConditionalGeneration)


# The tiny default (the entry's tiny_config): the real architecture at toy sizes.


def qwen2_5_vl_config(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool = False) -> Qwen2_5_VLConfig:
    """A Qwen2.5-VL config with toy sizes (about 0.2M parameters: 215,264 untied)."""
    text, vision, top = toy_parts(vocab_size, special_ids, tie_word_embeddings)
    text.update(num_hidden_layers=2, rope_theta=1_000_000.0,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})  # sums to head_dim/2 = 8
    vision.update(
        patch_size=14,
        window_size=56,  # 2x2 merged tokens per window: the 112 px image has 4 windows
        fullatt_block_indexes=[1],  # block 0 windowed, block 1 full attention
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **top)
