"""Samples → one micro-batch (right-padded, or packed without padding), with the label-token count.

The batch keeps HF's argument names, so the trainer can call the model with it after popping
``num_items`` and ``num_samples``.

Padded (default):

- ``input_ids [B, S]`` padded with the pad token, ``attention_mask [B, S]`` (1 on real tokens),
  ``labels [B, S]`` padded with ``-100``, ``mm_token_type_ids [B, S]`` when samples carry it.
  Right padding keeps every sample's positions (and mRoPE indices) equal to an unpadded run.

Packed (``packing=True``, padding-free):

- the same samples concatenated into one row: ``input_ids``, ``labels``, ``mm_token_type_ids``
  ``[1, ΣL]``, no ``attention_mask`` (transformers builds the block-causal mask from the
  positions), and ``packed_seq_lens [B]``: each sample's length, from which the model computes
  per-sample positions (:meth:`qwenkit.model.families.positions.Positions.packed_position_ids`);
- the first label of every sample after the first is ``-100``: the last token of sample ``k``
  must not learn to predict sample ``k+1``'s first token. A padded row never predicts its first
  label either, so loss, ``num_items`` and gradients equal the padded batch's.

Both modes:

- every other key a sample carries is per-media (``pixel_values``, ``image_grid_thw``,
  ``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``, ``input_features``,
  ``feature_attention_mask``, ...): concatenated along dim 0 in sample order, which is the order the
  model scatters features into placeholder tokens (audio features padded to the batch's longest
  audio first, :func:`join_media`);
- ``num_items``: label tokens that count after HF's causal shift, ``(labels[:, 1:] != -100).sum()``;
  summed over ranks and accumulation steps it is the ``token_mean`` denominator;
- ``num_samples``: ``B``;
- ``num_bad``: bad samples skipped while loading these samples (``data.on_bad_sample: skip``
  replaces each by the next good one), present only when there were some.
"""

from __future__ import annotations

import torch

from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.processor import Processor

SEQUENCE_KEYS = ("input_ids", "labels", "mm_token_type_ids")
# per-audio keys whose last dim is mel frames: a batch pads them to its longest audio (0: no frame)
FRAME_KEYS = ("input_features", "feature_attention_mask")
COUNT_KEYS = ("num_bad",)  # per-sample counts: summed over the batch, present when any sample has one


def join_media(key: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """One media key of several samples (or prompts) along dim 0, in their order; audio features and
    their masks (:data:`FRAME_KEYS`) first right-padded with 0 to the longest audio's frames, as HF's
    processor pads a batch's audios (the mask keeps each audio's own length)."""
    if key in FRAME_KEYS:
        width = max(p.shape[-1] for p in parts)
        parts = [torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p in parts]
    return torch.cat(parts)


class Collator:
    def __init__(self, processor: Processor, packing: bool = False):
        self.packing = packing
        self.pad_values = {
            "input_ids": processor.pad_token_id,
            "labels": IGNORE_INDEX,
            "mm_token_type_ids": 0,
        }

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty list of samples")
        lengths = [len(s["input_ids"]) for s in samples]
        batch = pack(samples) if self.packing else self._pad(samples, lengths)
        media = sorted({k for s in samples for k in s if k not in SEQUENCE_KEYS + COUNT_KEYS})
        for key in media:
            batch[key] = join_media(key, [s[key] for s in samples if key in s])
        for key in COUNT_KEYS:
            counts = [s[key] for s in samples if key in s]
            if counts:
                batch[key] = torch.stack(counts).sum()
        batch["num_items"] = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
        batch["num_samples"] = torch.tensor(len(samples), dtype=torch.long)
        return batch

    def _pad(self, samples, lengths: list[int]) -> dict[str, torch.Tensor]:
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
        return batch


def pack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The :data:`SEQUENCE_KEYS` of ``samples`` (each ``[L]``) as one packed row ``[1, ΣL]`` with its
    ``packed_seq_lens [B]`` (the module docstring; SFT's micro-batches and GRPO's rollout rows alike)."""
    lengths = [len(s["input_ids"]) for s in samples]
    batch = {key: torch.cat([s[key] for s in samples])[None, :].long() for key in SEQUENCE_KEYS if key in samples[0]}
    starts = torch.tensor(lengths[:-1], dtype=torch.long).cumsum(0)  # where samples 2.. begin
    batch["labels"][0, starts] = IGNORE_INDEX  # no sample predicts the next one's first token
    batch["packed_seq_lens"] = torch.tensor(lengths, dtype=torch.long)  # [B]
    return batch
