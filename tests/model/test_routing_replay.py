"""Rollout Routing Replay (``qwenkit.model.routing_replay``) on every MoE family's tiny model, in fp32.

References: the model's own forward (replaying the routers' own choice changes nothing, not a bit); HF's own
router made to pick the replayed experts (its logits masked to them: with the top-k renormalised, the weights
depend on the picked experts' logits only), log-probs and every gradient, the router's included; a forward
recomputed in backward (``parallel.recompute``) against one that is not; HF ``generate``'s recorded routing of a
completion against the full forward's own routing of ``prompt + completion``; packed against padded.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from conftest import over_families, tiny_checkpoint, tiny_processor

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.distributed import fsdp
from qwenkit.engine.generation.sampling import Sampling
from qwenkit.engine.rollouts.completion import completion_mask, training_batch
from qwenkit.engine.rollouts.hf import HfRollouts
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as families
from qwenkit.model.families.entry import routing_replay_problem
from qwenkit.model.routing_replay import UNROUTED, RoutingReplay

MOE = over_families(*(n for n, f in families.FAMILIES.items() if f.routers))
# transformers 4.x routes inside the MoE block (the router a linear): refused before start (test_routing_replay in engine)
pytestmark = pytest.mark.skipif(bool(why := routing_replay_problem(families.get("qwen3_vl_moe"))), reason=why or "")
# fp32: the replayed weights are the router's own top-k values gathered by index, renormalised in the same
# order; against the masked HF router the softmax runs over k experts instead of E: a few ulps
FP32 = dict(rtol=1e-5, atol=1e-6)
FP32_GRADS = dict(rtol=1e-5, atol=1e-5)  # gradients: sums over every token of the batch, their rounding as many times


def _model(family: str, seed: int = 0, router_scale: float = 1.0):
    cfg = qconfig.load(overrides=[f"model.name={family}", f"model.path={tiny_checkpoint(family)}", "train.objective=grpo",
                                  "data.tiny_samples=4"])  # fmt: skip
    torch.manual_seed(seed)
    model = registry.build(cfg.model, cfg.loss)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # near ties: tokens that a small change routes elsewhere
                p.mul_(router_scale)
    return cfg, model, RoutingReplay(model, families.get(family).routers)


def _batch(family: str, cfg, model, routing, generations: int = 3, dtype=None):
    """A few HF rollouts of the tiny model (their routing recorded) and their training batch."""
    processor = tiny_processor(family)
    bundle = data.build(cfg, processor)
    rollouts = HfRollouts(Sampling(8, temperature=1.0, seed=0), generations, dtype=dtype, record=True, routing=routing)
    done = rollouts(model, bundle.dataset, [0, 1], 0)
    return done, processor.pad_token_id


def _logps_and_grads(model, batch, routing=None, forced=None):
    model.zero_grad(set_to_none=True)
    with routing.replaying(forced) if routing is not None else contextlib.nullcontext():
        logps, _ = model.token_logps(**batch)
    mask = completion_mask(batch)
    weights = torch.linspace(-1, 1, mask.numel()).reshape(mask.shape)  # an upstream gradient per token
    (logps * weights * mask).sum().backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _routing_of(model, routing, batch) -> torch.Tensor:
    """``[layers, T, k]`` the routers' own choice over ``batch``'s tokens."""
    with torch.no_grad(), routing.recording() as calls:
        model.token_logps(**batch)
    return torch.stack([c[0] for c in calls])


@MOE
def test_replaying_the_routers_own_choice_is_the_models_own_forward_bit_for_bit(family):
    cfg, model, routing = _model(family)
    done, pad = _batch(family, cfg, model, routing)
    batch = training_batch(done, pad)
    batch.pop("routed_experts")
    own = _routing_of(model, routing, batch)
    free = _logps_and_grads(model, batch)
    replayed = _logps_and_grads(model, batch, routing, own)
    assert torch.equal(replayed[0], free[0])
    assert replayed[1].keys() == free[1].keys() and any(n.endswith("mlp.gate.weight") for n in free[1])
    for name, g in free[1].items():
        assert torch.equal(replayed[1][name], g), name


class _MaskedLinear:
    """``torch.nn.functional`` whose ``linear`` (in the modeling module: the router's logits alone) adds the masks
    of :attr:`masks`, one per call in layer order: HF's own router then picks the experts left finite."""

    def __init__(self, masks: list[torch.Tensor]):
        self.masks, self.calls = masks, 0

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    def linear(self, x, w, b=None):
        mask = self.masks[self.calls % len(self.masks)]
        self.calls += 1
        return torch.nn.functional.linear(x, w, b) + mask


@MOE
def test_replayed_experts_equal_hf_routers_that_pick_them_logps_and_every_gradient(family, monkeypatch):
    """The experts of a perturbed router (a sampler whose routing differs on some tokens) replayed, against the
    model whose HF routers are made to pick them: the log-probs and every gradient, the routers' own included
    (the gate weights carry the router's gradient)."""
    cfg, model, routing = _model(family, router_scale=0.05)
    done, pad = _batch(family, cfg, model, routing)
    batch = training_batch(done, pad)
    batch.pop("routed_experts")
    own = _routing_of(model, routing, batch)
    _, sampler, sampler_routing = _model(family, router_scale=0.05)
    torch.manual_seed(1)
    with torch.no_grad():
        for router in sampler_routing.routers:
            router.weight.add_(torch.randn_like(router.weight) * router.weight.std())
    other = _routing_of(sampler, sampler_routing, batch)
    flipped = (own.sort(-1).values != other.sort(-1).values).any(-1).float().mean().item()
    assert 0.05 < flipped < 1, flipped  # the perturbation routes some tokens elsewhere, not all
    free = _logps_and_grads(model, batch)
    replayed = _logps_and_grads(model, batch, routing, other)
    assert not torch.allclose(replayed[0], free[0], **FP32)  # the flipped tokens' experts matter
    routing.remove()
    masks = [torch.full(o.shape[:1] + (model.config.get_text_config().num_experts,), -torch.inf).scatter_(1, o.long(), 0.0)
             for o in other]  # fmt: skip
    modeling = importlib.import_module(type(routing.routers[0]).__module__)
    monkeypatch.setattr(modeling, "F", _MaskedLinear(masks))
    hf = _logps_and_grads(model, batch)
    torch.testing.assert_close(replayed[0], hf[0], **FP32)
    assert replayed[1].keys() == hf[1].keys()
    for name, g in hf[1].items():
        torch.testing.assert_close(replayed[1][name], g, **FP32_GRADS, msg=lambda m, name=name: f"{name}: {m}")


@MOE
def test_a_forward_recomputed_in_backward_replays_what_its_forward_replayed(family):
    """``parallel.recompute`` wraps the decoder layers: the routers run again inside backward, outside the
    replaying block; the gradients equal those of the forward without recompute."""
    cfg, model, routing = _model(family, router_scale=0.05)
    done, pad = _batch(family, cfg, model, routing)
    batch = training_batch(done, pad)
    forced = batch.pop("routed_experts")
    experts = model.config.get_text_config().num_experts
    forced = torch.where(forced == UNROUTED, forced, (forced + 1) % experts)  # other experts than its own choice
    model.train()
    plain = _logps_and_grads(model, batch, routing, forced)
    assert fsdp.apply_recompute(model, "auto")
    recomputed = _logps_and_grads(model, batch, routing, forced)
    torch.testing.assert_close(recomputed[0], plain[0], rtol=0, atol=0)
    for name, g in plain[1].items():
        torch.testing.assert_close(recomputed[1][module_name(name, recomputed[1])], g, rtol=0, atol=0, msg=name)


def module_name(name: str, grads: dict) -> str:
    """``name`` as checkpoint_wrapper spells it, if it wraps the module."""
    return name if name in grads else next(n for n in grads if n.replace("._checkpoint_wrapped_module", "") == name)


@MOE
def test_the_rollouts_recorded_routing_is_the_full_forwards_own_and_packs_as_padded(family):
    """HF ``generate`` in fp32 (KV cache, left padding, one token a step) records, for every token it fed, the
    experts the trainer's full forward over ``prompt + completion`` routes it to; the last token is never fed
    (:data:`UNROUTED`); a packed micro-batch replays to the padded one's log-probs."""
    cfg, model, routing = _model(family)
    done, pad = _batch(family, cfg, model, routing)
    for c in done:
        assert c.routing.shape[:2] == (routing.layers, c.prompt["input_ids"].shape[1] + len(c.tokens))
        assert (c.routing[:, -1] == UNROUTED).all() and (c.routing[:, :-1] != UNROUTED).all()
    batch = training_batch(done, pad)
    recorded = batch.pop("routed_experts")
    own = _routing_of(model, routing, batch)
    fed = recorded[..., 0] != UNROUTED  # [layers, T]
    mask = batch["attention_mask"].reshape(1, -1).bool().expand_as(fed)
    assert (fed <= mask).all() and fed.sum() > 0
    agree = (recorded.sort(-1).values == own.to(recorded.dtype).sort(-1).values).all(-1)[fed]
    assert agree.float().mean() > 0.99, agree.float().mean()  # (a near tie may flip at fp32 rounding)
    if "packing" in families.get(family).not_exact:  # the Omni thinkers refuse packing before start
        return
    padded = _logps_and_grads(model, batch, routing, recorded)
    packed_batch = training_batch(done, pad, packing=True)
    packed = _logps_and_grads(model, packed_batch, routing, packed_batch.pop("routed_experts"))
    torch.testing.assert_close(packed[0], padded[0], **FP32)


def test_a_replay_of_another_shape_is_refused_naming_the_layer():
    family = "qwen3_vl_moe"
    cfg, model, routing = _model(family)
    done, pad = _batch(family, cfg, model, routing, generations=2)
    batch = training_batch(done, pad)
    forced = batch.pop("routed_experts")
    with pytest.raises(ValueError, match=r"grpo\.routing_replay: layer 0's router routes"):
        _logps_and_grads(model, batch, routing, forced[:, 1:])
    with pytest.raises(ValueError, match=r"layers recorded, the model routes"):
        _logps_and_grads(model, batch, routing, forced[1:])
