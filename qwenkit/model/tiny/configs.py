"""The sizes and token ids every family's tiny config shares (each family's module builds its own on them).

A family's tiny config is its real architecture at toy sizes (the tiny checkpoint's ``config.json``),
built by the function its entry names as ``tiny_config``, in the family's module of
:mod:`qwenkit.model.families` (``qwen2_5_vl_config`` in ``families/qwen2_5_vl.py``, ...);
:mod:`qwenkit.model.tiny.checkpoint` writes the checkpoint.
"""

from __future__ import annotations


def toy_parts(vocab_size: int, special_ids: dict[str, int], tie_word_embeddings: bool) -> tuple[dict, dict, dict]:
    """The sizes and token ids every family's tiny config shares: ``(text, vision, top-level)``."""
    text = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA as in the real models
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=special_ids["<|endoftext|>"],
        eos_token_id=special_ids["<|im_end|>"],
        pad_token_id=special_ids["<|endoftext|>"],
        tie_word_embeddings=tie_word_embeddings,
    )
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64)  # fmt: skip
    top = dict(
        image_token_id=special_ids["<|image_pad|>"],
        video_token_id=special_ids["<|video_pad|>"],
        vision_start_token_id=special_ids["<|vision_start|>"],
        vision_end_token_id=special_ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
    )
    return text, vision, top
