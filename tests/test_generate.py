"""HF's ``generate`` on the qwenkit subclass (chunk loss off) gives HF's class's tokens.

``generate`` validates its model kwargs against ``forward``'s signature, so the subclass must
expose the parent's parameters (images, video, ``inputs_embeds``), on transformers 5.x and 4.57.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from test_model import _video_batch
from transformers import Qwen2_5_VLForConditionalGeneration

from qwenkit.model import processor, qwen2_5_vl

NEW_TOKENS = 6


@pytest.fixture
def pair(make_model, tiny_path):
    """The subclass with random weights, and HF's own class holding the very same weights."""
    ours = make_model(chunk=False, seed=7).eval()
    stock = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_path).eval()
    stock.load_state_dict(ours.state_dict())
    return ours, stock


def _prompt(batch: dict) -> dict:
    """A generation prompt: no labels; ``mm_token_type_ids`` only where transformers takes it."""
    keep = {k: v for k, v in batch.items() if k != "labels"}
    if not processor.needs_mm_token_type_ids():
        keep.pop("mm_token_type_ids", None)
    return keep


def _generate(model, **kwargs):
    with torch.no_grad():
        return model.generate(**kwargs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)


def test_forward_exposes_the_parents_parameters():
    ours = inspect.signature(qwen2_5_vl.QwenkitQwen2_5_VL.forward).parameters
    parent = inspect.signature(Qwen2_5_VLForConditionalGeneration.forward).parameters
    assert list(ours)[: len(parent) - 1] == list(parent)[:-1]  # same names, same positional order
    assert {"num_items_in_batch", "num_samples", "return_dict", "kwargs"} <= set(ours)


def test_generate_with_images_equals_hf(pair, batch_factory):
    ours, stock = pair
    prompt = _prompt(batch_factory(images_per_sample=(2,), seed=3))
    got, want = _generate(ours, **prompt), _generate(stock, **prompt)
    assert got.shape[1] == prompt["input_ids"].shape[1] + NEW_TOKENS
    assert torch.equal(got, want)


def test_generate_with_video_equals_hf(pair, processor):
    ours, stock = pair
    prompt = _prompt(_video_batch(processor, seed=2))
    got, want = _generate(ours, **prompt), _generate(stock, **prompt)
    assert got.shape[1] == prompt["input_ids"].shape[1] + NEW_TOKENS
    assert torch.equal(got, want)


def test_generate_from_inputs_embeds_equals_hf(pair, batch_factory):
    ours, stock = pair
    prompt = _prompt(batch_factory(images_per_sample=(0,), seed=4))
    embeds = ours.get_input_embeddings()(prompt.pop("input_ids")).detach()
    prompt.pop("mm_token_type_ids", None)  # text only
    got, want = _generate(ours, inputs_embeds=embeds, **prompt), _generate(stock, inputs_embeds=embeds, **prompt)
    assert got.shape[1] == NEW_TOKENS  # from embeddings, generate returns the new tokens only
    assert torch.equal(got, want)


def test_positional_arguments_follow_the_parents_order(pair, batch_factory):
    ours, stock = pair
    batch = batch_factory(images_per_sample=(0, 0), seed=5)
    with torch.no_grad():
        got = ours(batch["input_ids"], batch["attention_mask"]).logits
        want = stock(batch["input_ids"], batch["attention_mask"]).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
