"""The tensors a vLLM weight push sends (qwenkit.engine.generation.push_tensors) against peft's own merge.

Without vLLM (it runs in every environment): a model with LoRA adapters, B random (a real delta), on its linears
and (``lora.target_experts``) its routed experts' fused weights: the pushed tensors are the state dict of peft's
merged copy (``lora.merge_in_place``), key for key under HF's names, and the adapters moved the experts. What vLLM
makes of them is tests/engine/generation/test_vllm_engine.py's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_checkpoint

from qwenkit import config as qconfig
from qwenkit.engine.generation.push_tensors import hf_tensors
from qwenkit.model import lora
from qwenkit.model.families import registry as families


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_the_pushed_tensors_are_peft_merged_state_dict(family):
    entry = families.get(family)
    if entry.unavailable():
        pytest.skip(entry.unavailable())
    path = tiny_checkpoint(family)
    model = entry.load("hf_class").from_pretrained(path, dtype=torch.float32).eval()
    experts = ["lora.target_experts=true", "lora.dropout=0"] if entry.experts else []
    lora.apply(model, qconfig.load(overrides=["lora.r=4", "lora.alpha=8", *experts]).lora, seed=0)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)
    want = lora.merge_in_place(copy.deepcopy(model)).state_dict()
    got = dict(hf_tensors(model))
    assert got.keys() == want.keys()
    for k in got:
        # fp32: the same products and sums as peft's (a linear's B @ A, the experts' einsum), summed in one order
        torch.testing.assert_close(got[k], want[k], rtol=1.3e-6, atol=1e-7, msg=k)
    unmerged = {lora.base_key(n): p for n, p in model.named_parameters()}
    moved = [k for k in got if ".experts." in k and not torch.equal(got[k], unmerged[k])]
    assert len(moved) == (2 * model.config.text_config.num_hidden_layers if entry.experts else 0)
