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


# the measured models' sizes (--shapes): the CPU config, Qwen2.5-VL-3B's, and a seconds-long smoke check
CPU_SHAPES = dict(
    text=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=2, mrope_section=[8, 12, 12]),
    vision=dict(depth=2, hidden_size=256, intermediate_size=688, num_heads=4, fullatt_block_indexes=[1]),
    image_side=224, seq=2048, dtype="float32", tie=False,
)  # fmt: skip
GPU_3B_SHAPES = dict(  # Qwen2.5-VL-3B-Instruct
    text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
              num_key_value_heads=2, mrope_section=[16, 24, 24]),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, fullatt_block_indexes=[7, 15, 23, 31]),
    image_side=448, seq=4096, dtype="bfloat16", tie=True,
)  # fmt: skip
TINY_SHAPES = dict(  # a smoke check of the script in seconds (--shapes tiny), not a measurement
    text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, mrope_section=[4, 6, 6]),
    vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, fullatt_block_indexes=[1]),
    image_side=64, seq=256, dtype="float32", tie=False,
)  # fmt: skip
SHAPES = {"cpu": CPU_SHAPES, "3b": GPU_3B_SHAPES, "tiny": TINY_SHAPES}


def make_qwen3_config(shapes: dict):
    """A Qwen3-VL config of the same text sizes (``--family qwen3_vl``): 16-px patches, a learned
    48x48 position grid, DeepStack from vision block 0, interleaved mRoPE of the same section."""
    from transformers import Qwen3VLConfig

    base = make_config(shapes)
    text, vision = base.text_config.to_dict(), shapes["vision"]
    text.update(head_dim=text["hidden_size"] // text["num_attention_heads"],
                rope_scaling={"rope_type": "default", "mrope_section": shapes["text"]["mrope_section"],
                              "mrope_interleaved": True})  # fmt: skip
    vision = dict(depth=vision["depth"], hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
                  num_heads=vision["num_heads"], patch_size=16, num_position_embeddings=48 * 48,
                  deepstack_visual_indexes=[0], out_hidden_size=text["hidden_size"])  # fmt: skip
    ids = {k: getattr(base, f"{k}_token_id") for k in ("image", "video", "vision_start", "vision_end")}
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=shapes["tie"],
                         **{f"{k}_token_id": v for k, v in ids.items()})  # fmt: skip

QWEN3_5_VOCAB = 248_320  # Qwen3.5's vocabulary: the chunked head's ratios are measured at it

def make_qwen3_5_config(shapes: dict):
    """A Qwen3.5 config of the same text sizes (``--family qwen3_5``) at Qwen3.5's 248,320 vocabulary:
    layers in the checkpoints' pattern (every 4th full attention, the others Gated DeltaNet with half
    as many key heads as value heads, head dim 128 as in the 9B), partial rotary (a quarter of
    head_dim), Qwen3-VL's tower without DeepStack."""
    from transformers import Qwen3_5Config

    base = make_config(shapes, vocab=QWEN3_5_VOCAB)
    text = base.text_config.to_dict()
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    head_dim = hidden // text["num_attention_heads"]
    half = head_dim // 4 // 2  # rotary dims / 2
    value_heads = max(2, hidden // 128)
    text = {k: text[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}  # fmt: skip
    text.update(head_dim=head_dim, linear_num_value_heads=value_heads, linear_num_key_heads=value_heads // 2,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                # every 4th full attention, and the last layer (a 2-layer smoke config still has one)
                layer_types=["full_attention" if i % 4 == 3 or i == layers - 1 else "linear_attention" for i in range(layers)],
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [half - 2 * (half // 3), half // 3, half // 3], "mrope_interleaved": True})  # fmt: skip
    vision = shapes["vision"]
    vision = dict(depth=vision["depth"], hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
                  num_heads=vision["num_heads"], patch_size=16, num_position_embeddings=48 * 48,
                  out_hidden_size=hidden)  # fmt: skip
    ids = {k: getattr(base, f"{k}_token_id") for k in ("image", "video", "vision_start", "vision_end")}
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=shapes["tie"],
                         **{f"{k}_token_id": v for k, v in ids.items()})  # fmt: skip


# --family: the config of those shapes


# --family: the config of those shapes
CONFIGS = {"qwen2_5_vl": make_config, "qwen3_vl": make_qwen3_config, "qwen3_5": make_qwen3_5_config}
