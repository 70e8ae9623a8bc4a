"""The Omni thinkers (Qwen2.5-Omni, Qwen3-Omni-MoE) with the chunked loss head.

transformers 5.x builds each thinker as it builds the VL model of its generation: a multimodal backbone under ``model``
(``audio_tower``, ``visual``, ``language_model``) that scatters the audio, image and video features
into the placeholder tokens and computes the mRoPE positions (audio included), then ``lm_head``. So
the shared chunk-loss steps run it unchanged (Qwen3-Omni adds Qwen3-VL's DeepStack tower and MoE
router, :mod:`qwenkit.model.families.qwen3_vl`'s parts); what hearing adds is here (:class:`_Hearing`):

- the seconds per video grid are ``video_second_per_grid`` here (:meth:`_drop_unsupported`);
- a batch whose ids hold a video heard with its audio track (``data.use_audio_in_video``: ``<vision_start>``
  then the audio start token) is run with ``use_audio_in_video=True`` (:meth:`heard_videos`), the flag HF's
  ``get_rope_index`` reads to interleave that span's video and audio positions by time; a batch without one
  is run without it. The flag is one per batch: every video of a batch is heard (a silent video is a bad row,
  :func:`qwenkit.data.audio.track`) and rows without videos are placed alike either way;
- the audio tower joins the idle calls of data parallelism: a rank whose micro-batch has no audio
  runs it on one blank window (x 0), so that every audio parameter gets a gradient on every rank
  (:meth:`_idle_vision`, :meth:`blank_audio_term`).

The talker and token2wav are not part of this model; export puts the thinker back beside them.
"""

from __future__ import annotations

import torch
from transformers import (
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen3OmniMoeThinkerForConditionalGeneration,
)
from transformers.modeling_outputs import MultimodalCausalLMOutputWithPast
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_qwen3_omni

from qwenkit.model.families.chunked import ChunkLossMixin
from qwenkit.model.families.positions import heard_video, thinker_keywords
from qwenkit.model.families.qwen3_vl import RouterAuxLoss, _DeepStack
from qwenkit.model.families.subclass import finish_subclass


class _Hearing:
    """The audio tower's part of a thinker's chunk-loss forward (both Omni families)."""

    def _drop_unsupported(self, kwargs: dict, input_ids: torch.Tensor | None = None) -> dict:
        """The batch's keywords under the thinker's names (:func:`thinker_keywords`)."""
        return thinker_keywords(self.config, super()._drop_unsupported(kwargs, input_ids), input_ids)

    def heard_videos(self, input_ids: torch.Tensor | None) -> bool:
        return heard_video(self.config, input_ids)

    def _idle_vision(self, input_ids, kwargs) -> torch.Tensor | None:
        """The idle vision calls this rank owes, plus (data parallel: the trainer pads vision calls) a
        zero-valued audio-tower call when this micro-batch has no audio. The audio tower is no shard
        unit of its own (it lives in the root's parameters), so its call issues no collective and
        needs no place in the order; it gives its parameters a gradient on every rank, which the
        root's reduce-scatter expects."""
        idle = super()._idle_vision(input_ids, kwargs)
        if not self.vision_calls_per_step or kwargs.get("input_features") is not None:
            return idle
        term = self.blank_audio_term()
        return term if idle is None else idle + term

    def blank_audio_term(self) -> torch.Tensor:
        """0 x (HF's audio features of one blank window of ``2 * n_window`` mel frames)."""
        tower = self.model.audio_tower
        param = next(tower.parameters())
        frames = 2 * tower.n_window
        features = torch.zeros(1, tower.num_mel_bins, frames, device=param.device, dtype=param.dtype)
        mask = torch.ones(1, frames, device=param.device, dtype=torch.long)
        out = self.model.get_audio_features(features, feature_attention_mask=mask, return_dict=True)
        return out.last_hidden_state.sum() * 0.0


class QwenkitQwen2_5OmniThinker(_Hearing, ChunkLossMixin, Qwen2_5OmniThinkerForConditionalGeneration):
    """The Qwen2.5-Omni thinker whose training loss can be computed without full logits (``chunk_loss``)."""

    output_class = MultimodalCausalLMOutputWithPast

    def audio_tokens(self, frames: torch.Tensor) -> torch.Tensor:
        """Placeholder tokens of audios of ``frames`` mel frames: the stride-2 convolution, then the stride-2 pooling."""
        return self.model.audio_tower._get_feat_extract_output_lengths(frames)[1]


class QwenkitQwen3OmniMoeThinker(_Hearing, _DeepStack, RouterAuxLoss, ChunkLossMixin, Qwen3OmniMoeThinkerForConditionalGeneration):
    """The Qwen3-Omni (MoE) thinker: DeepStack, the router's aux loss as HF's forward adds it, and hearing."""

    output_class = hf_qwen3_omni.MultimodalMoeCausalLMOutputWithPast
    balancing_loss = staticmethod(hf_qwen3_omni.load_balancing_loss_func)

    def audio_tokens(self, frames: torch.Tensor) -> torch.Tensor:
        """Placeholder tokens of audios of ``frames`` mel frames: 13 per full window of 100 frames, then
        three stride-2 convolutions over the rest (HF's ``_get_feat_extract_output_lengths``)."""
        return hf_qwen3_omni._get_feat_extract_output_lengths(frames)


finish_subclass(QwenkitQwen2_5OmniThinker, Qwen2_5OmniThinkerForConditionalGeneration)
finish_subclass(QwenkitQwen3OmniMoeThinker, Qwen3OmniMoeThinkerForConditionalGeneration)
