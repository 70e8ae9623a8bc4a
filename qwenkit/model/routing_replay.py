"""Rollout Routing Replay (R3, ``grpo.routing_replay``): the experts the sampler routed each token to, replayed
in the trainer's forward, so a MoE policy's importance ratios compare the same experts.

A MoE policy's sampler (HF ``generate`` with a KV cache, another batch, another precision) and its trainer
(one full forward) compute slightly different hidden states; where a token's top-k experts are near a tie, the
two route it to different experts and its log-probs differ by far more than the rounding: ratios away from 1
that clipping then discards (Megatron-LM #4168: GRPO on a MoE collapses without replay). R3 (verl
``enable_routing_replay`` / ``routing_replay.mode: R3``, Megatron ``moe_enable_routing_replay``, ms-swift's router
replay) records the sampler's choice and forces it on the trainer.

**One home: a forward hook on each router** (the family entry's ``routers``: in transformers 5.x a module whose
forward returns ``(router_logits [T, E], top_k_weights [T, k], top_k_index [T, k])``, the same in every MoE
family, :class:`RoutingReplay`):

- :meth:`RoutingReplay.recording`: each router's ``top_k_index`` of every call appended, per layer (a
  rollout's prefill, then one call per decoded token);
- :meth:`RoutingReplay.replaying` (``[layers, T, k]``, the forward's tokens in the order the router sees them):
  the indices replaced by the recorded ones and the weights recomputed from the *current* router logits over
  those experts, as the router does it (softmax over every expert in fp32, the top-k gathered, renormalised
  where the router renormalises: ``norm_topk_prob``, always for Qwen3-VL-MoE and Qwen3.5-MoE; cast to the
  logits' dtype), so the router still learns through the weights (Megatron's replay: indices forced, probs
  from the live scores). A token recorded as :data:`UNROUTED` (the completion's last token, never fed to the
  sampler; padding) keeps the router's own choice. The logits (the aux loss's input) are untouched;
- a forward recomputed inside backward (``parallel.recompute``) replays what its forward replayed (Megatron's
  ``REPLAY_BACKWARD``): each router keeps the indices of its last forward that trained.

Replaying indices equal to the router's own choice gives back the router's own output exactly
(tests/model/test_routing_replay.py). The reference model (``grpo.beta > 0``) routes by itself: its
log-probs anchor the KL, they are not an importance ratio's.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from qwenkit.model.modules import module_path, path_match

UNROUTED = -1  # a token the sampler's routing was not recorded for: the router routes it itself
INDEX_DTYPE = torch.int16  # recorded indices as kept with a rollout (expert counts stay below 2**15)


def router_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[nn.Module]:
    """The routers (the family entry's ``routers`` paths), in model order (layer order)."""
    found = [m for n, m in model.named_modules() if any(path_match(module_path(n), p) for p in patterns)]
    if not found:
        raise ValueError(f"grpo.routing_replay: no module of {type(model).__name__} matches {list(patterns)}")
    return found


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class RoutingReplay:
    """Hooks on ``model``'s routers that record their choices or force recorded ones (module docstring)."""

    def __init__(self, model: nn.Module, patterns: tuple[str, ...]):
        self.routers = router_modules(model, patterns)
        self.calls: list[list[torch.Tensor]] | None = None  # recording: per layer, each call's [T, k]
        self.forced: torch.Tensor | None = None  # replaying: [layers, T, k]
        self.last: list[torch.Tensor | None] = [None] * len(self.routers)  # each layer's last trained replay
        self.hooks = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    @property
    def layers(self) -> int:
        return len(self.routers)

    def _hook(self, layer: int):
        def hook(module, args, out):
            logits, weights, index = out
            if self.calls is not None:
                self.calls[layer].append(index.detach())
                return None
            trains = module.training and torch.is_grad_enabled()
            if self.forced is not None:
                forced = self.forced[layer].to(device=index.device, dtype=torch.long)  # [T, k]
                if forced.shape != index.shape:
                    raise ValueError(f"grpo.routing_replay: layer {layer}'s router routes {tuple(index.shape)} "
                                     f"(tokens, k) and the rollout recorded {tuple(forced.shape)}")  # fmt: skip
                if trains:
                    self.last[layer] = forced
            elif trains and _in_backward() and self.last[layer] is not None:
                forced = self.last[layer]  # a recomputed forward replays its forward's routing
            else:
                if trains:
                    self.last[layer] = None  # a forward without replay: its recompute routes by itself too
                return None
            return logits, *replayed(module, logits, index, forced)

        return hook

    @contextlib.contextmanager
    def recording(self):
        """Yields the per-layer lists of every router call's ``top_k_index`` ``[T, k]`` made in the block."""
        self.calls = [[] for _ in self.routers]
        try:
            yield self.calls
        finally:
            self.calls = None

    @contextlib.contextmanager
    def replaying(self, forced: torch.Tensor | None):
        """The block's forwards route their tokens to ``forced`` ``[layers, T, k]`` (None: the routers' own)."""
        if forced is not None and forced.shape[0] != self.layers:
            raise ValueError(f"grpo.routing_replay: {forced.shape[0]} layers recorded, the model routes {self.layers}")
        self.forced = forced
        try:
            yield
        finally:
            self.forced = None

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def replayed(router: nn.Module, logits: torch.Tensor, own: torch.Tensor, forced: torch.Tensor):
    """``(top_k_weights, top_k_index)`` of ``router`` routing to ``forced`` ``[T, k]`` (rows of :data:`UNROUTED`
    take the router's ``own`` choice): the weights from ``logits`` ``[T, E]`` as HF's top-k router computes them."""
    index = torch.where(forced[:, :1] == UNROUTED, own, forced)  # [T, k]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # [T, E]
    weights = probs.gather(1, index)  # [T, k]
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), index


def decoded_rows(calls: list[list[torch.Tensor]], rows: int, prompt_width: int, pads: list[int],
                 lengths: list[int]) -> list[torch.Tensor]:  # fmt: skip
    """Each row's routing ``[layers, prompt + completion, k]`` from a ``generate`` call's recorded router calls:
    its left-padded prompt's (``pads[b]`` pads, of ``prompt_width``) from the prefill (``[rows * width, k]``), its
    token ``t``'s from call ``t + 1`` (``[rows, k]``: the token fed back), :data:`UNROUTED` for the tokens of
    ``lengths[b]`` never fed (the last one sampled)."""
    out = []
    for b in range(rows):
        layers = []
        for per_call in calls:
            prefill = per_call[0].reshape(rows, prompt_width, -1)[b, pads[b] :]  # [P, k]
            new = torch.full((lengths[b], prefill.shape[1]), UNROUTED, dtype=prefill.dtype, device=prefill.device)
            fed = min(lengths[b], len(per_call) - 1)
            if fed:
                new[:fed] = torch.stack([per_call[t + 1].reshape(rows, -1)[b] for t in range(fed)])
            layers.append(torch.cat([prefill, new]))
        out.append(torch.stack(layers).to("cpu", INDEX_DTYPE))  # [layers, P + L, k]
    return out


def batch_routing(rows: list[torch.Tensor], width: int | None) -> torch.Tensor:
    """A micro-batch's ``[layers, B * width, k]`` from its rows' ``[layers, L_b, k]``, each right-padded with
    :data:`UNROUTED` to ``width`` (the padded batch), or ``[layers, ΣL, k]`` (``width`` None: the packed row):
    the order the router sees the batch's tokens in (``[B, S, H]`` flattened)."""
    if width is None:
        return torch.cat(rows, dim=1)
    layers, _, k = rows[0].shape
    out = torch.full((layers, len(rows), width, k), UNROUTED, dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        out[:, b, : r.shape[1]] = r
    return out.reshape(layers, len(rows) * width, k)


__all__ = ["INDEX_DTYPE", "UNROUTED", "RoutingReplay", "batch_routing", "decoded_rows", "replayed", "router_modules"]
