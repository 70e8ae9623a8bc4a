"""Qwen3-VL (dense and MoE) with the chunked loss head.

The backbone runs as HF runs it (DeepStack, interleaved mRoPE, the MoE router); what differs from
Qwen2.5-VL for the shared machinery (:mod:`qwenkit.model.families.chunked`) is here:

- the vision tower returns its merged features *and* the DeepStack features of the
  ``deepstack_visual_indexes`` blocks (:meth:`QwenkitQwen3VL.vision_tower`); the decoder adds
  those to the visual positions after its first layers (``visual_pos_masks`` and
  ``deepstack_visual_embeds``, :meth:`_decoder_visual_kwargs`, used on a sequence-parallel slice);
- MoE: the router's load-balancing loss joins the training loss exactly as HF's forward adds it
  (``router_aux_loss_coef x load_balancing_loss_func(router_logits, ...)``, only when
  ``output_router_logits``, :meth:`QwenkitQwen3VLMoe._aux_loss`).
"""

from __future__ import annotations

import inspect

import torch
from transformers import (
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf_moe

try:  # the class HF's forward returns: transformers 5.x
    from transformers.modeling_outputs import MultimodalCausalLMOutputWithPast as CausalLMOutput
except ImportError:  # 4.57
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLCausalLMOutputWithPast as CausalLMOutput

from qwenkit.model.families.chunked import ChunkLossMixin
from qwenkit.model.families.subclass import finish_subclass


class _DeepStack:
    """The DeepStack parts of the Qwen3-VL family's chunk-loss forward (dense and MoE alike)."""

    def vision_tower(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        out = self.model.visual(pixels, grid_thw=grid_thw)
        if isinstance(out, tuple):  # 4.57: (merged, deepstack list)
            merged, deepstack = out
        else:
            merged, deepstack = out.pooler_output, out.deepstack_features
        return [merged, *deepstack]

    def _decoder_visual_kwargs(self, visual_mask: torch.Tensor, extra: list[torch.Tensor]) -> dict:
        return {"visual_pos_masks": visual_mask, "deepstack_visual_embeds": extra}


class QwenkitQwen3VL(_DeepStack, ChunkLossMixin, Qwen3VLForConditionalGeneration):
    """Qwen3-VL (dense) whose training loss can be computed without full logits (``chunk_loss``)."""

    output_class = CausalLMOutput


class RouterAuxLoss:
    """A MoE family's router loss, joined to the training loss exactly as HF's forward adds it
    (``router_aux_loss_coef x balancing_loss(router_logits, ...)``, only when ``output_router_logits``).
    ``balancing_loss``: the family's own ``load_balancing_loss_func``."""

    balancing_loss = staticmethod(hf_moe.load_balancing_loss_func)

    def _router_logits_wanted(self, kwargs: dict) -> bool:
        """HF's rule: 5.x defaults to the text config's ``output_router_logits``; 4.57 adds the aux
        loss only when the call passes ``output_router_logits=True``."""
        wanted = kwargs.get("output_router_logits")
        if wanted is None:
            return bool(self.config.text_config.output_router_logits) if _CONFIG_DEFAULT else False
        return bool(wanted)

    def _prepare_backbone(self, kwargs: dict) -> None:
        kwargs["output_router_logits"] = self._router_logits_wanted(kwargs)

    def _aux_loss(self, outputs, attention_mask) -> tuple[torch.Tensor, float] | None:
        logits = getattr(outputs, "router_logits", None)
        if not logits:  # output_router_logits off: HF adds nothing
            return None
        text = self.config.text_config
        aux = self.balancing_loss(logits, text.num_experts, text.num_experts_per_tok, attention_mask)
        return aux, text.router_aux_loss_coef


class QwenkitQwen3VLMoe(_DeepStack, RouterAuxLoss, ChunkLossMixin, Qwen3VLMoeForConditionalGeneration):
    """Qwen3-VL-MoE: the chunked head plus the router's auxiliary loss, as HF's forward adds it."""

    output_class = hf_moe.Qwen3VLMoeCausalLMOutputWithPast


# 5.x declares output_router_logits (default: the config's); 4.57 reads it from **kwargs only
_CONFIG_DEFAULT = "output_router_logits" in inspect.signature(Qwen3VLMoeForConditionalGeneration.forward).parameters

finish_subclass(QwenkitQwen3VL, Qwen3VLForConditionalGeneration)
finish_subclass(QwenkitQwen3VLMoe, Qwen3VLMoeForConditionalGeneration)
