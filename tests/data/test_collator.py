"""qwenkit.data.collator: right padding, the attention mask, the shifted-label count, media in sample order."""

from __future__ import annotations

import torch

from qwenkit.data import Collator
from qwenkit.model.processor import needs_mm_token_type_ids


def test_collator_pads_right_and_counts_shifted_labels(processor):
    def sample(ids, labels, n_patches=0, grid=None):
        s = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
        if needs_mm_token_type_ids():
            s["mm_token_type_ids"] = torch.zeros(len(ids), dtype=torch.long)
        if n_patches:
            s["pixel_values"] = torch.full((n_patches, 1176), float(n_patches))
            s["image_grid_thw"] = torch.tensor([grid])
        return s

    samples = [
        sample([5, 6, 7], [5, -100, 7], 16, [1, 4, 4]),
        sample([8, 9, 10, 11, 12], [8, 9, -100, -100, 12]),
        sample([13], [-100], 4, [1, 2, 2]),
    ]
    batch = Collator(processor)(samples)
    pad = processor.pad_token_id
    assert batch["input_ids"].tolist() == [[5, 6, 7, pad, pad], [8, 9, 10, 11, 12], [13, pad, pad, pad, pad]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[5, -100, 7, -100, -100], [8, 9, -100, -100, 12], [-100] * 5]
    # after the causal shift the first label of each row never counts: 7, 9, 12
    assert batch["num_items"].item() == 3 and batch["num_items"].dim() == 0
    assert batch["num_samples"].item() == 3
    assert batch["pixel_values"][:, 0].tolist() == [16.0] * 16 + [4.0] * 4  # sample order
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2]]
    assert ("mm_token_type_ids" in batch) == needs_mm_token_type_ids()
    text_only = Collator(processor)([samples[1]])
    assert "pixel_values" not in text_only and "image_grid_thw" not in text_only
