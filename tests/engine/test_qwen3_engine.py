"""Qwen3-VL-MoE's engine rules: which linears LoRA adapts, and the pre-start refusal of sequence
parallelism while the router's auxiliary loss is on (the loss of a slice is not the loss of the
sequence: checked here against HF's own ``load_balancing_loss_func``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf_moe

from qwenkit import config as qconfig
from qwenkit import launch
from qwenkit.model import lora
from qwenkit.model.families import build as registry

MOE = ["model.name=qwen3_vl_moe", "parallel.nproc=2"]


@pytest.fixture(scope="module")
def moe(_cache):
    cfg = qconfig.load(overrides=MOE)
    return registry.build(dataclasses.replace(cfg.model, init_device="meta"))


def test_all_linear_on_moe_adapts_attention_not_the_router_or_experts(moe):
    targets, problems = lora.target_problems(moe, qconfig.load(overrides=[*MOE, "lora.r=4"]).lora)
    assert not problems
    layers = moe.config.text_config.num_hidden_layers
    attention = {f"model.language_model.layers.{i}.self_attn.{p}_proj" for i in range(layers) for p in "qkvo"}
    assert set(targets) == attention
    routers = [n for n, m in moe.named_modules() if n.endswith("mlp.gate")]
    assert len(routers) == layers  # a linear in 4.57, a router module with a weight in 5.x: never adapted
    assert any(isinstance(p, nn.Parameter) and p.dim() == 3 for n, p in moe.named_parameters() if ".experts." in n)
    # naming the router explicitly matches nothing LoRA may adapt, and says so before start
    _, problems = lora.target_problems(moe, qconfig.load(overrides=[*MOE, "lora.r=4", "lora.target_modules=[gate]"]).lora)
    assert problems == ["lora.target_modules: 'gate' matches no linear layer of the language model (lora.vision=false)"]


def test_the_aux_loss_of_a_slice_is_not_the_loss_of_the_sequence():
    """Why the refusal below exists: HF's aux loss over 2 slices, averaged, differs from the whole."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(16, 4, generator=g) * 2,)  # one layer, 16 tokens, 4 experts
    whole = hf_moe.load_balancing_loss_func(logits, 4, 2)
    halves = [hf_moe.load_balancing_loss_func((part,), 4, 2) for part in logits[0].split(8)]
    assert not torch.allclose(whole, sum(halves) / 2, rtol=1e-3)


@pytest.mark.parametrize(
    "overrides, refused",
    [
        ([*MOE, "parallel.sp_size=2"], True),
        ([*MOE], False),
        (["model.name=qwen3_vl", "parallel.nproc=2", "parallel.sp_size=2"], False),  # dense: no router
    ],
)
def test_sp_with_the_router_aux_loss_is_refused_before_start(tmp_path, monkeypatch, capsys, overrides, refused):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("spawned") if refused else 0)
    code = launch.launch(None, [*overrides, f"train.output_dir={tmp_path}", "loss.chunk=true"])
    err = capsys.readouterr().err
    assert ("router's auxiliary loss on" in err) is refused
    if refused:
        assert code == 2 and "parallel.sp_size=2" in err and "output_router_logits=true" in err
