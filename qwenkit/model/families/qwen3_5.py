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
from transformers.modeling_outputs import MultimodalCausalLMOutputWithPast
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe

from qwenkit.model.families import linear_attention
from qwenkit.model.families.chunked import ChunkLossMixin
from qwenkit.model.families.qwen3_vl import RouterAuxLoss
from qwenkit.model.families.subclass import finish_subclass
from qwenkit.model.tiny.configs import toy_parts


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


# The tiny default (the entry's tiny_config): the real architecture at toy sizes.


def _qwen3_5_parts(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool) -> tuple[dict, dict, dict]:
    """Qwen3.5's hybrid decoder at toy sizes: three Gated DeltaNet layers, then one gated full attention."""
    text, vision, top = toy_parts(vocab_size, special_ids, tie_word_embeddings)
    text.update(
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        head_dim=32,
        # partial rotary (a quarter of head_dim), interleaved mRoPE: the section sums to 32 * 0.25 / 2 = 4
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # two value heads per key head, as in the real checkpoints
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    )  # fmt: skip
    vision.update(patch_size=16, num_position_embeddings=16)  # Qwen3-VL's tower without DeepStack
    return text, vision, top


def qwen3_5_config(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool = False):
    """A Qwen3.5 (dense) config with toy sizes: layers 0-2 linear attention, layer 3 full attention."""
    from transformers import Qwen3_5Config  # transformers 5.x only: 4.57 has no Qwen3.5

    text, vision, top = _qwen3_5_parts(vocab_size, special_ids, tie_word_embeddings)
    return Qwen3_5Config(text_config=text, vision_config=vision, **top)


def qwen3_5_moe_config(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool = False):
    """A Qwen3.5-MoE config with toy sizes: 4 experts, 2 per token, a gated shared expert, the aux loss on."""
    from transformers import Qwen3_5MoeConfig  # transformers 5.x only

    text, vision, top = _qwen3_5_parts(vocab_size, special_ids, tie_word_embeddings)
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                output_router_logits=True, router_aux_loss_coef=0.01)  # fmt: skip
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, **top)
