"""qwenkit.distributed.meta: a model built on meta has no parameter storage and the real buffers of one
built normally; ``register_parameter`` is restored after (also when the build fails); tied weights are
found as the names that share one tensor."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

from qwenkit.distributed import meta


def test_parameters_on_meta_buffers_real_and_equal_to_a_normal_build(tiny_path):
    config = AutoConfig.from_pretrained(tiny_path)
    original = nn.Module.register_parameter
    torch.manual_seed(0)
    real = Qwen2_5_VLForConditionalGeneration(config)
    built = meta.build_on_meta(Qwen2_5_VLForConditionalGeneration, config)
    assert [(n, p.shape) for n, p in built.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    assert {p.device.type for p in built.parameters()} == {"meta"}
    buffers = dict(real.named_buffers())
    assert buffers  # rotary inv_freq: computed in __init__, what meta init takes from this twin
    for name, buffer in built.named_buffers():
        assert buffer.device.type == "cpu", name
        torch.testing.assert_close(buffer, buffers[name], rtol=0, atol=0, msg=name)  # the same computation
    assert nn.Module.register_parameter is original
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # outside the context: real parameters again


def test_register_parameter_is_restored_when_the_build_fails():
    original = nn.Module.register_parameter

    class Broken(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.a = nn.Linear(2, 2)
            raise RuntimeError(config)

    with pytest.raises(RuntimeError, match="bad config"):
        meta.build_on_meta(Broken, "bad config")
    assert nn.Module.register_parameter is original


def test_tied_groups_and_set_buffer():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False), nn.Linear(5, 5))
    assert meta.tied_groups(model) == []
    model[1].weight = model[0].weight  # a tied head: one tensor, two names
    assert meta.tied_groups(model) == [["0.weight", "1.weight"]]
    model.register_buffer("scale", torch.ones(2), persistent=False)
    model[2].register_buffer("steps", torch.zeros(1))
    meta.set_buffer(model, "scale", torch.full((2,), 3.0))
    meta.set_buffer(model, "2.steps", torch.ones(1))
    assert model.scale.tolist() == [3.0, 3.0] and model[2].steps.tolist() == [1.0]
    assert "scale" not in model.state_dict() and "2.steps" in model.state_dict()  # persistence kept
