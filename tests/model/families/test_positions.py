"""A packed row's positions (:mod:`qwenkit.model.families.positions`) against the model's own ``get_rope_index``
on the padded batch of the same samples."""

from __future__ import annotations

import torch
from data.test_packing import DENSE_FAMILIES, IMAGES, samples_of

from qwenkit.data import Collator
from qwenkit.model.processor import needs_mm_token_type_ids


@DENSE_FAMILIES
def test_per_sample_positions_equal_unpacked(family_processor, make_model, batch_factory):
    processor = family_processor
    padded = batch_factory(images_per_sample=IMAGES, seed=3)
    packed = Collator(processor, packing=True)(samples_of(processor, padded))
    model = make_model(chunk=False, seed=0)
    media = {k: packed[k] for k in ("mm_token_type_ids", "image_grid_thw") if k in packed}
    positions = model.packed_position_ids(packed["input_ids"], packed["packed_seq_lens"], media)  # [4, 1, ΣL]
    extra = {"mm_token_type_ids": padded["mm_token_type_ids"]} if needs_mm_token_type_ids() else {}
    reference, _ = model.model.get_rope_index(  # HF's padded path: [3, B, S]
        padded["input_ids"], image_grid_thw=padded["image_grid_thw"], attention_mask=padded["attention_mask"], **extra
    )
    start = 0
    for r, n in enumerate(packed["packed_seq_lens"].tolist()):
        assert positions[0, 0, start : start + n].tolist() == list(range(n))  # text row restarts
        assert torch.equal(positions[1:, 0, start : start + n], reference[:, r, :n])
        start += n
    assert start == positions.shape[-1]
