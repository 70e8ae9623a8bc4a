"""Each family's tiny config: its real architecture at toy sizes (the tiny checkpoints' ``config.json``).

Configuration classes only (no modeling code), so the tiny checkpoints are written by any transformers that
has the family's config (the vLLM environment's too). Every attention head, decoder and vision, is 32 wide: the
smallest vLLM's CPU attention runs (``vllm_limits.VLLM_CPU_HEAD_SIZES``), so vLLM runs the embedded default as it is.
Qwen2.5-VL (:func:`qwen2_5_vl_config`): two vision
blocks (one windowed, one with full attention), the 2x2 patch merger, mRoPE with ``mrope_section`` summing to
``head_dim / 2``, and a two-layer GQA text decoder. Qwen3-VL (:func:`qwen3_vl_config`): 16-px patches with a
learned, interpolated position grid, two LayerNorm/GELU vision blocks that both feed DeepStack mergers (added
after decoder layers 0 and 1 of three), interleaved mRoPE, q/k norms; the MoE variant
(:func:`qwen3_vl_moe_config`) has four experts, two per token, and the router's auxiliary loss on. Qwen3.5:
three Gated DeltaNet layers, then one full attention. The Omni thinkers, and the whole Omni models around them
(talker and vocoder at toy sizes). The family's entry (:mod:`qwenkit.model.families.registry`) names its
builder; :mod:`qwenkit.model.tiny.checkpoint` writes the checkpoint. A new family adds its builder here.
"""

from __future__ import annotations

from transformers import Qwen2_5_VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig


def toy_parts(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool) -> tuple[dict, dict, dict]:
    """The sizes and token ids every family's tiny config shares: ``(text, vision, top-level)``."""
    text = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,  # head dim 32: the smallest vLLM's CPU attention runs (VLLM_CPU_HEAD_SIZES)
        num_key_value_heads=1,  # GQA as in the real models
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=special_ids["<|endoftext|>"],
        eos_token_id=special_ids["<|im_end|>"],
        pad_token_id=special_ids["<|endoftext|>"],
        tie_word_embeddings=tie_word_embeddings,
    )
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=1, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64)  # one head of 32, as the decoder's: vLLM runs it  # fmt: skip
    top = dict(
        image_token_id=special_ids["<|image_pad|>"],
        video_token_id=special_ids["<|video_pad|>"],
        vision_start_token_id=special_ids["<|vision_start|>"],
        vision_end_token_id=special_ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
    )
    return text, vision, top


def qwen2_5_vl_config(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool = False) -> Qwen2_5_VLConfig:
    """A Qwen2.5-VL config with toy sizes (about 0.2M parameters: 215,264 untied)."""
    text, vision, top = toy_parts(vocab_size, special_ids, tie_word_embeddings)
    text.update(num_hidden_layers=2, rope_theta=1_000_000.0,
                rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]})  # sums to head_dim/2 = 16
    vision.update(
        patch_size=14,
        window_size=56,  # 2x2 merged tokens per window: the 112 px image has 4 windows
        fullatt_block_indexes=[1],  # block 0 windowed, block 1 full attention
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **top)


def qwen3_parts(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool) -> tuple[dict, dict, dict]:
    """Qwen3-VL's tower and decoder at toy sizes (DeepStack, interleaved mRoPE): also Qwen3-Omni's."""
    text, vision, top = toy_parts(vocab_size, special_ids, tie_word_embeddings)
    text.update(
        num_hidden_layers=3,  # DeepStack adds after layers 0 and 1: the last one must follow them
        num_attention_heads=4,  # Qwen3 names its head dim: 4 heads of 32 (q wider than hidden, as Qwen3-VL-30B-A3B's)
        num_key_value_heads=2,
        head_dim=32,
        # interleaved mRoPE: the section sums to head_dim/2 = 16 (4.57 reads rope_scaling; 5.x converts it)
        rope_theta=5_000_000.0,
        rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": True},
    )
    vision.update(
        patch_size=16,
        num_position_embeddings=16,  # a 4x4 learned grid, interpolated to each image's
        deepstack_visual_indexes=[0, 1],  # two DeepStack mergers, added after decoder layers 0 and 1
    )
    return text, vision, top


def qwen3_vl_config(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool = False) -> Qwen3VLConfig:
    """A Qwen3-VL (dense) config with toy sizes."""
    text, vision, top = qwen3_parts(vocab_size, special_ids, tie_word_embeddings)
    return Qwen3VLConfig(text_config=text, vision_config=vision, **top)


def qwen3_vl_moe_config(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool = False) -> Qwen3VLMoeConfig:
    """A Qwen3-VL-MoE config with toy sizes: 4 experts, 2 per token, the router's aux loss on."""
    text, vision, top = qwen3_parts(vocab_size, special_ids, tie_word_embeddings)
    # moe_intermediate_size 16: the fused gate_up_proj [E, 2·16, 64] is not square, so transformers 5.x's load tells
    # Qwen's published layout (the vLLM tests' copy holds it: qwenkit.model.tiny.vllm) from its own and transposes it
    # norm_topk_prob as Qwen's config.json says it: HF's router always renormalises its top-k, vLLM reads the key
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                mlp_only_layers=[], output_router_logits=True, router_aux_loss_coef=0.01, norm_topk_prob=True)  # fmt: skip
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, **top)


def _qwen3_5_parts(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool) -> tuple[dict, dict, dict]:
    """Qwen3.5's hybrid decoder at toy sizes: three Gated DeltaNet layers, then one gated full attention."""
    text, vision, top = toy_parts(vocab_size, special_ids, tie_word_embeddings)
    text.update(
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
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


def qwen2_5_omni_config(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool = False):
    """A Qwen2.5-Omni thinker config with toy sizes: Qwen2.5-VL's tower and decoder plus a two-layer
    Whisper-style audio encoder (two convolutions, the second halving the 128 mel frames' rate, windowed
    attention over ``n_window * 2`` frames, then a stride-2 pooling: one token per 4 frames, 40 ms)."""
    from transformers import Qwen2_5OmniThinkerConfig  # absent from transformers 4.x before 4.52

    text, vision, top = toy_parts(vocab_size, special_ids, tie_word_embeddings)
    text.update(num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                                      "mrope_section": [4, 6, 6]})  # fmt: skip
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
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [4, 6, 6],
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


def qwen4_exp_config(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool = False):
    """A Qwen4-Exp config with toy sizes, every feature on: three Gated DeltaNet layers (sigmoid output gate)
    then one full attention with the QSA indexer (blocks of 4 tokens, 8 selected per query: short samples fit
    whole, longer ones select), 4 experts (2 per token) and a shared expert, 2 hyper-connection streams, PLE on
    layers 1 and 3 (bigrams and trigrams, 2 hashed heads each, a ~300-row table in 2 checkpoint parts)."""
    from transformers import Qwen4ExpConfig  # transformers >= 5.23 only

    text, vision, top = _qwen3_5_parts(vocab_size, special_ids, tie_word_embeddings)
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                output_router_logits=True, router_aux_loss_coef=0.01, output_gate_type="sigmoid",
                layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                hc_count=2, hc_lowrank=16,
                ple_layer_ids=[1, 3], ple_embed_dim=32, ple_conv_kernel_size=2, ngram_size=3, heads_per_ngram=2,
                ngram_vocab_size_base=61, make_ngram_vocab_size_divisible_by=16, split_ngram_parts=2,
                indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                indexer_compress_ratio=4)  # fmt: skip
    text["rope_parameters"] = {**text["rope_parameters"], "partial_rotary_factor": 0.25}  # rotary 8 <= indexer 16
    return Qwen4ExpConfig(text_config=text, vision_config=vision, **top)
