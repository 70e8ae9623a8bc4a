"""qwenkit.engine.run.expert_load against the router's own choice: HF's router logits (``output_router_logits``),
their top-k per token counted by hand; only the forwards that train are counted, a recomputed one once."""

from __future__ import annotations

import pytest
import torch
from conftest import build_model, make_batch, over_families, tiny_processor

from qwenkit.distributed import fsdp
from qwenkit.engine.run import expert_load
from qwenkit.model.families import registry as families

MOE = tuple(name for name in families.FAMILIES if families.get(name).experts)


def _by_hand(model, batch) -> torch.Tensor:
    """``[layers, E]``: each token's top-k experts by HF's router logits, counted."""
    text = model.config.get_text_config()
    with torch.no_grad():
        logits = model(**batch, output_router_logits=True).router_logits  # per layer [T, E]
    return torch.stack([torch.bincount(layer.topk(text.num_experts_per_tok, dim=-1).indices.reshape(-1),
                                       minlength=text.num_experts) for layer in logits]).double()  # fmt: skip


@over_families(*MOE)
def test_the_counts_are_the_routers_top_k_of_the_forwards_that_train(family):
    model = build_model(chunk=True, seed=0, name=family)
    batch = make_batch(tiny_processor(family), images_per_sample=(1, 0), seed=0)
    want = _by_hand(model, batch)
    load = expert_load.ExpertLoad.of(model, torch.device("cpu"))
    assert expert_load.ExpertLoad.of(build_model(seed=0), torch.device("cpu")) is None  # a dense model: nothing to count
    model.train()
    model(**batch).loss.backward()
    with torch.no_grad():
        model(**batch)  # no gradient: not counted (GRPO's old log-probs, evaluation)
    model.eval()
    model(**batch)  # eval mode: not counted
    assert torch.equal(load.counts, want)
    values = load.values()
    mean = want.mean(1, keepdim=True)
    torch.testing.assert_close(torch.tensor(load.fractions, dtype=torch.float64), want / want.sum(1, keepdim=True))
    per_layer = [values[f"expert_load/layer_{i:02d}"] for i in range(len(want))]
    assert per_layer == pytest.approx((want.max(1, keepdim=True).values / mean).squeeze(1).tolist())
    assert values["expert_load/max_over_mean"] == max(per_layer) >= 1.0
    assert load.counts.sum() == 0  # the next step starts from zero


@pytest.mark.parametrize("family", ["qwen3_vl_moe"])
def test_a_recomputed_forward_is_counted_once(family):
    model = build_model(chunk=True, seed=0, name=family)
    batch = make_batch(tiny_processor(family), images_per_sample=(1, 0), seed=0)
    want = _by_hand(model, batch)
    assert fsdp.apply_recompute(model, "auto")  # the decoder layers run again in backward
    load = expert_load.ExpertLoad.of(model, torch.device("cpu"))
    model.train()
    model(**batch).loss.backward()
    assert torch.equal(load.counts, want)
