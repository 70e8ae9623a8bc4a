"""Qwen2.5-Omni's thinker with the chunked loss head: HF's class plus :class:`~qwenkit.model.chunked.ChunkLossMixin`.

transformers 5.x builds the thinker as it builds Qwen2.5-VL: a multimodal backbone under ``model``
(``audio_tower``, ``visual``, ``language_model``) that scatters the audio, image and video features
into the placeholder tokens and computes the mRoPE positions (audio included), then ``lm_head``. So
the shared chunk-loss steps run it unchanged; what is the thinker's own is here:

- the seconds per video grid are ``video_second_per_grid`` here (:meth:`_drop_unsupported`);
- the audio tower joins the idle calls of data parallelism: a rank whose micro-batch has no audio
  runs it on one blank window (x 0), so that every audio parameter gets a gradient on every rank
  (:meth:`_idle_vision`, :meth:`blank_audio_term`).

The talker and token2wav are not part of this model; export puts the thinker back beside them.
"""

from __future__ import annotations

import torch
from transformers import Qwen2_5OmniThinkerForConditionalGeneration
from transformers.modeling_outputs import MultimodalCausalLMOutputWithPast

from qwenkit.model.chunked import ChunkLossMixin, finish_subclass


class QwenkitQwen2_5OmniThinker(ChunkLossMixin, Qwen2_5OmniThinkerForConditionalGeneration):
    """The Qwen2.5-Omni thinker whose training loss can be computed without full logits (``chunk_loss``)."""

    output_class = MultimodalCausalLMOutputWithPast

    def _drop_unsupported(self, kwargs: dict) -> dict:
        """The batch's ``second_per_grid_ts`` (the collator's name, Qwen2.5-VL's) as the thinker's
        ``video_second_per_grid``: the seconds per temporal patch its mRoPE times video frames by."""
        kwargs = super()._drop_unsupported(kwargs)
        if "second_per_grid_ts" in kwargs:
            kwargs = dict(kwargs)
            kwargs["video_second_per_grid"] = kwargs.pop("second_per_grid_ts")
        return kwargs

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
        """0 x (audio tower on one blank window of ``2 * n_window`` mel frames)."""
        tower = self.model.audio_tower
        param = next(tower.parameters())
        frames = 2 * tower.n_window
        features = torch.zeros(tower.num_mel_bins, frames, device=param.device, dtype=param.dtype)
        lengths = torch.tensor([frames], device=param.device)
        after_cnn, _ = tower._get_feat_extract_output_lengths(lengths)
        out = tower(features, feature_lens=lengths, aftercnn_lens=after_cnn)
        return out.last_hidden_state.sum() * 0.0


finish_subclass(QwenkitQwen2_5OmniThinker, Qwen2_5OmniThinkerForConditionalGeneration)
