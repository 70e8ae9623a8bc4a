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
from qwenkit.model.families.qwen3_vl import RouterAuxLoss, _DeepStack, qwen3_parts
from qwenkit.model.families.subclass import finish_subclass
from qwenkit.model.tiny.configs import toy_parts


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


# The tiny default (the entry's tiny_config): the real architecture at toy sizes.


def qwen2_5_omni_config(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool = False):
    """A Qwen2.5-Omni thinker config with toy sizes: Qwen2.5-VL's tower and decoder plus a two-layer
    Whisper-style audio encoder (two convolutions, the second halving the 128 mel frames' rate, windowed
    attention over ``n_window * 2`` frames, then a stride-2 pooling: one token per 4 frames, 40 ms)."""
    from transformers import Qwen2_5OmniThinkerConfig  # absent from transformers 4.x before 4.52

    text, vision, top = toy_parts(vocab_size, special_ids, tie_word_embeddings)
    text.update(num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                                      "mrope_section": [2, 3, 3]})  # fmt: skip
    vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1], in_channels=3)
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=text["hidden_size"], n_window=50, max_source_positions=1500)  # fmt: skip
    # Qwen2.5-Omni spells its image and video ids *_token_index
    top = {k.replace("_token_id", "_token_index") if k.startswith(("image", "video")) else k: v for k, v in top.items()}
    top.update(audio_token_index=special_ids["<|AUDIO|>"], audio_start_token_id=special_ids["<|audio_bos|>"],
               audio_end_token_id=special_ids["<|audio_eos|>"], position_id_per_seconds=25, seconds_per_chunk=2)  # fmt: skip
    return Qwen2_5OmniThinkerConfig(text_config=text, vision_config=vision, audio_config=audio, **top)


def qwen3_omni_moe_config(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool = False):
    """A Qwen3-Omni (MoE) thinker config with toy sizes: Qwen3-VL-MoE's tower (DeepStack) and decoder (4
    experts, 2 per token, the router's aux loss on) plus Qwen3-Omni's audio encoder (three stride-2
    convolutions over windows of ``2 * n_window`` mel frames: 13 tokens per full window of 100)."""
    from transformers import Qwen3OmniMoeThinkerConfig  # transformers 5.x only

    text, vision, top = qwen3_parts(vocab_size, special_ids, tie_word_embeddings)
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                mlp_only_layers=[], output_router_logits=True, router_aux_loss_coef=0.01)  # fmt: skip
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3],
                               "mrope_interleaved": True}  # fmt: skip
    del text["rope_theta"], text["rope_scaling"]
    audio = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=text["hidden_size"], n_window=50, n_window_infer=100, conv_chunksize=500,
                 downsample_hidden_size=16, max_source_positions=1500)  # fmt: skip
    del top["vision_end_token_id"]  # Qwen3-Omni's thinker has none
    # position_id_per_seconds: its processor's rate (a heard video's pads interleaved by time at 13 a second), not
    # transformers' config default (25, Qwen2.5-Omni's): get_rope_index must place them at the rate they were written
    top.update(audio_token_id=special_ids["<|audio_pad|>"], audio_start_token_id=special_ids["<|audio_start|>"],
               position_id_per_seconds=13)  # fmt: skip
    return Qwen3OmniMoeThinkerConfig(text_config=text, vision_config=vision, audio_config=audio, **top)



# The whole Omni models around the tiny thinkers (Whole.tiny_config): a talker and a vocoder at toy sizes, so that
# an export into the whole model is tested against HF's class of it. Their token ids are the thinker's.


def _talker_ids(thinker) -> dict:
    return dict(audio_token_id=thinker.audio_token_id, image_token_id=thinker.image_token_id,
                video_token_id=thinker.video_token_id, vision_start_token_id=thinker.vision_start_token_id,
                audio_start_token_id=thinker.audio_start_token_id)  # fmt: skip


def qwen2_5_omni_whole_config(thinker):
    """Qwen2.5-Omni whole: the tiny thinker, a one-layer talker (a codec vocabulary of 64) and token2wav (a
    two-layer DiT, a two-stage BigVGAN)."""
    from transformers import Qwen2_5OmniConfig

    ids = _talker_ids(thinker)
    talker = dict(vocab_size=64, embedding_size=thinker.text_config.hidden_size, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
                  audio_token_index=ids.pop("audio_token_id"), image_token_index=ids.pop("image_token_id"),
                  video_token_index=ids.pop("video_token_id"), audio_end_token_id=thinker.audio_end_token_id,
                  vision_end_token_id=thinker.vision_end_token_id, tts_codec_start_token_id=60,
                  tts_codec_end_token_id=61, tts_codec_pad_token_id=62, tts_codec_mask_token_id=63, **ids)  # fmt: skip
    dit = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16, emb_dim=16, num_embeds=64,
               mel_dim=8, enc_emb_dim=8, enc_dim=8, enc_channels=[16, 16, 16, 16, 24], enc_attention_channels=8,
               enc_se_channels=8, look_ahead_layers=[1], look_backward_layers=[0])  # fmt: skip
    bigvgan = dict(mel_dim=8, upsample_initial_channel=16, resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]],
                   upsample_rates=[2, 2], upsample_kernel_sizes=[4, 4])  # fmt: skip
    return Qwen2_5OmniConfig(thinker_config=thinker.to_dict(), talker_config=talker,
                             token2wav_config=dict(dit_config=dit, bigvgan_config=bigvgan))  # fmt: skip


def qwen3_omni_moe_whole_config(thinker):
    """Qwen3-Omni whole: the tiny thinker, a one-layer MoE talker (2 experts and a shared one) with a one-layer
    code predictor over 4 code groups, and a one-layer code2wav."""
    from transformers import Qwen3OmniMoeConfig

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)  # fmt: skip
    text = dict(small, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=32)
    talker = dict(text_config=text, code_predictor_config=dict(small, num_code_groups=4), num_code_groups=4,
                  thinker_hidden_size=thinker.text_config.hidden_size, accept_hidden_layer=1, spatial_merge_size=2,
                  codec_eos_token_id=50, codec_nothink_id=51, codec_think_bos_id=52, codec_think_eos_id=53,
                  codec_pad_id=54, codec_bos_id=55, **_talker_ids(thinker))  # fmt: skip
    code2wav = dict(codebook_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                    num_hidden_layers=1, num_quantizers=4, upsample_rates=[2, 2], upsampling_ratios=[2], decoder_dim=32,
                    sliding_window=8)  # fmt: skip
    return Qwen3OmniMoeConfig(thinker_config=thinker.to_dict(), talker_config=talker, code2wav_config=code2wav)
