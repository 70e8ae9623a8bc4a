"""Synthetic Qwen2.5-VL models and image-text batches: the one recipe the model benchmarks share.

:func:`make_config` lays out the real architecture (mRoPE text decoder with GQA, windowed vision
tower, 2x2 patch merger) at the sizes a benchmark names; :func:`make_batch` makes rows of random
text with one random image in the middle, labelled as SFT data is. Weights and pixels are random:
the benchmarks measure time and memory and compare variants on the same inputs, so only the
shapes and the share of learned labels matter.
"""

from __future__ import annotations

VOCAB = 151_936  # Qwen2.5-VL's vocabulary
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 151_655, 151_656, 151_652, 151_653
QWEN_IDS = {"image": IMAGE_PAD, "video": VIDEO_PAD, "vision_start": VISION_START, "vision_end": VISION_END}
QWEN_ORDINARY = 150_000  # random text in Qwen's vocabulary: ids below its special tokens (151,643 and up)


def make_config(shapes: dict, vocab: int = VOCAB, ids: dict = QWEN_IDS, max_positions: int = 32_768, **text):
    """A Qwen2.5-VL config of ``shapes["text"]`` and ``shapes["vision"]`` sizes; ``shapes["tie"]``: tied embeddings.

    ``shapes["text"]`` holds the decoder's sizes and its ``mrope_section`` (summing to head_dim / 2);
    ``shapes["vision"]`` may override the vision defaults below (14 px patches, 2x2 merge, two
    frames per temporal patch, 112 px windows, output width = the text hidden size). ``ids``: the
    image, video and vision start/end token ids; ``text``: further text-config keys (token ids,
    ``rms_norm_eps``).
    """
    from transformers import Qwen2_5_VLConfig  # on use: importing this module (and --help) stays light

    sizes = dict(shapes["text"])
    section = sizes.pop("mrope_section")
    tie = shapes.get("tie", False)
    text_config = dict(
        vocab_size=vocab, **sizes, max_position_embeddings=max_positions, rope_theta=1e6,
        rope_scaling={"type": "mrope", "mrope_section": section}, tie_word_embeddings=tie, **text,
    )  # fmt: skip
    vision_config = {
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        "out_hidden_size": sizes["hidden_size"], **shapes["vision"],
    }  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config, image_token_id=ids["image"],
        video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], tie_word_embeddings=tie,
    )  # fmt: skip


def make_batch(config, seq: int, image_side: int, samples: int = 1, learn_prompt: bool = True,
               ordinary: int | None = None, device="cpu") -> dict:  # fmt: skip
    """``samples`` rows of ``seq`` tokens: random text with one random ``image_side`` px image after its first half.

    The image span (``<|vision_start|>``, the image tokens, ``<|vision_end|>``) is never learned;
    with ``learn_prompt=False`` neither is the text before it, so only the reply after the image
    is, as in SFT. Text ids are drawn from ``[0, ordinary)``, by default every id below the
    config's vision tokens. Seeded: every call with the same arguments gives the same batch.
    """
    import torch  # on use, as above

    from qwenkit.model.losses.cross_entropy import IGNORE_INDEX

    vc = config.vision_config
    grid = image_side // vc.patch_size  # patches per side
    n_image = grid * grid // vc.spatial_merge_size**2  # image tokens after the merge
    n_text = seq - n_image - 2
    if n_text < 0:
        raise ValueError(f"seq={seq} tokens cannot hold a {image_side} px image ({n_image} image tokens + 2 marks)")
    prompt = n_text // 2
    vision = (config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id)
    ordinary = ordinary or min(vision)
    span = torch.tensor([config.vision_start_token_id] + [config.image_token_id] * n_image + [config.vision_end_token_id])
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(samples):
        text = torch.randint(0, ordinary, (n_text,), generator=g)
        rows.append(torch.cat([text[:prompt], span, text[prompt:]]))
    input_ids = torch.stack(rows)  # [samples, seq]
    labels = input_ids.clone()
    labels[:, (prompt if learn_prompt else 0) : prompt + n_image + 2] = IGNORE_INDEX
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "mm_token_type_ids": (input_ids == config.image_token_id).int(),  # 5.x builds mRoPE from it; 4.57 drops it
        "pixel_values": torch.randn(samples * grid * grid, 3 * vc.temporal_patch_size * vc.patch_size**2, generator=g),
        "image_grid_thw": torch.tensor([[1, grid, grid]] * samples),
    }
    return {k: v.to(device) for k, v in batch.items()}
