"""Samples → one right-padded micro-batch, with the label-token count the loss divides by.

The batch keeps HF's argument names, so the trainer can call the model with it after popping
``num_items`` and ``num_samples``:

- ``input_ids [B, S]`` padded with the pad token, ``attention_mask [B, S]`` (1 on real tokens),
  ``labels [B, S]`` padded with ``-100``, ``mm_token_type_ids [B, S]`` when samples carry it;
- ``pixel_values [P, C*T*patch²]`` and ``image_grid_thw [I, 3]`` concatenated in sample order
  (the model scatters image features into pad tokens in that order), only if any sample has images;
- ``pixel_values_videos [P', C*T*patch²]``, ``video_grid_thw [V, 3]`` and ``second_per_grid_ts [V]``
  the same way for videos;
- ``num_items``: label tokens that count after HF's causal shift, ``(labels[:, 1:] != -100).sum()``;
  summed over ranks and accumulation steps it is the ``token_mean`` denominator;
- ``num_samples``: ``B``.

Right padding keeps every sample's positions (and mRoPE indices) equal to an unpadded run.
"""

from __future__ import annotations

import torch

from qwenkit.loss import IGNORE_INDEX
from qwenkit.processor import Processor

SEQUENCE_KEYS = ("input_ids", "labels", "mm_token_type_ids")
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


class Collator:
    def __init__(self, processor: Processor):
        self.pad_values = {
            "input_ids": processor.pad_token_id,
            "labels": IGNORE_INDEX,
            "mm_token_type_ids": 0,
        }

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        lengths = [len(s["input_ids"]) for s in samples]
        width = max(lengths)
        batch: dict[str, torch.Tensor] = {}
        for key in SEQUENCE_KEYS:
            if key not in samples[0]:
                continue
            out = torch.full((len(samples), width), self.pad_values[key], dtype=torch.long)  # [B, S]
            for b, s in enumerate(samples):
                out[b, : lengths[b]] = s[key]
            batch[key] = out
        batch["attention_mask"] = (
            torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        ).long()  # [B, S]
        for key in MEDIA_KEYS:
            parts = [s[key] for s in samples if key in s]
            if parts:
                batch[key] = torch.cat(parts)
        batch["num_items"] = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        batch["num_samples"] = torch.tensor(len(samples), dtype=torch.long)
        return batch
