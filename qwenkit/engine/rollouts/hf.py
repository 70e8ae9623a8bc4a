"""Rollouts on HF ``generate``: ``grpo.num_generations`` completions of each prompt, sampled from the current policy.

One engine behind the interface of :mod:`qwenkit.engine.rollouts.completion` (:class:`~qwenkit.engine.rollouts.completion.Rollouts`,
:class:`~qwenkit.engine.rollouts.completion.Completion`), beside :mod:`qwenkit.engine.rollouts.vllm`.

:class:`HfRollouts` generates through HF ``generate`` with a KV cache, from the policy's own weights:

- **gathered once** (``gather``): every FSDP2 unit all-gathered once for the whole rollout
  (:func:`qwenkit.distributed.unshard.unsharded`) and kept whole; each rank then generates alone, with
  no collective per token: the all-gathers of a rollout are one per unit, whatever the completions'
  length (TRL, verl and EasyR1 likewise gather the weights once per rollout into their engine);
- **in lockstep** (``lockstep``): the sharded model itself, every rank stepping together (HF's
  ``synced_gpus``, :func:`qwenkit.engine.generation.placement.lockstep`), every forward all-gathering
  every unit: for a policy whose whole weights do not fit a rank beside its training state, and
  under expert parallelism (the experts' all-to-all makes every forward collective anyway);
- a model with column-sharded tables (Qwen4-Exp's n-gram tables, never gathered: each lookup an exchange,
  :mod:`qwenkit.distributed.columns`) steps in step either way: its units gathered once or not, every rank
  runs every forward (``synced_gpus``) for the tables' lookups;
- ``auto``: ``gather`` when the whole weights, one call's KV cache and a margin fit every rank,
  else ``lockstep``: evaluation's rule (:func:`qwenkit.engine.generation.placement.choose_generation`).

**Batched across prompts.** Every completion of the rank's prompts (``len(indices) x
num_generations`` rows) goes through ``generate`` calls of ``grpo.rollout_batch_size`` rows (0: all
in one call), longest prompts first, left-padded as evaluation batches its rows (a row's tokens do
not depend on its batch: :mod:`qwenkit.engine.generation.generate`). Prompts come from
:meth:`qwenkit.data.dataset.EncodedDataset.prompt` (every turn before the row's last reply, with its
images and videos, or the whole conversation of a prompt-only row); the reference is the row's
``solution`` / ``answer`` column where it has one, else that reply (:mod:`qwenkit.data.conversation`).

**GEMMs in a lower precision** (``dtype``, ``grpo.rollout_dtype``): every ``nn.Linear`` of the policy
(the GEMMs: decoding's time, the vocabulary-wide head's most of all) computes in ``dtype``, its input,
weight and bias cast, its output cast back; norms, attention and the KV cache stay in the weights' dtype
(:func:`low_precision_gemms`). Gathered, each weight is cast once for the rollout (a half-size copy
beside the whole weights, dropped when it ends); in lockstep, at every call: the same numbers. On this
CPU a bf16 GEMM of decoding's skinny shapes runs ~4x an fp32 one, while bf16 attention over a long KV
cache runs ~5x slower than fp32's, hence not autocast, which casts both (docs/PERFORMANCE.md). The
completions are then samples of another distribution than the trainer's: each carries its sampler's
log-probs (``Completion.sampling_logps``, :class:`~qwenkit.engine.generation.sampling.RowSampler`'s
``record``) and GRPO corrects for them as for vLLM's (:mod:`qwenkit.engine.objectives.grpo`).

**Routing recorded** (``grpo.routing_replay``, a MoE policy): the experts each router picked for every token
of a completion's prompt (the prefill) and of its sampled tokens (each fed back in the next decoding step;
the last one never is), kept with the completion (``Completion.routing``) for the trainer's forward to replay
(:mod:`qwenkit.model.routing_replay`).

**Reproducible.** Completion ``g`` of row ``i`` draws from its own generator, seeded by
``(train.seed, draw, i, g)`` (:func:`completion_seed`; :class:`qwenkit.engine.generation.sampling.RowSampler`):
it depends neither on the rank that draws it nor on the rows that share its batch, so 2 ranks sample
what 1 process samples, a resumed run what the uninterrupted one did, at any batch size. Image and
video tokens are never drawn (:func:`~qwenkit.engine.rollouts.completion.media_tokens`). The training RNG is left where it was.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qwenkit.distributed import columns
from qwenkit.distributed.unshard import unsharded
from qwenkit.engine.generation.generate import (
    Sampling,
    dummy_prompt,
    generation_config,
    left_pad,
    one_token,
    prompt_inputs,
)  # fmt: skip
from qwenkit.engine.generation.placement import choose_generation, lockstep
from qwenkit.engine.generation.sampling import RowSampler
from qwenkit.engine.rollouts.completion import Completion, completion, completion_seed, media_tokens
from qwenkit.model.routing_replay import RoutingReplay, decoded_rows

log = logging.getLogger(__name__)
WHERE = ("auto", "gather", "lockstep")  # where a rollout's weights come from (module docstring)


class HfRollouts:
    """Rollouts through HF ``generate`` on the policy's weights, gathered once or in lockstep (module docstring).

    ``batch_size``: completions per ``generate`` call (0: all of the rank's); ``where``: one of
    :data:`WHERE`; ``collective``: the model's forward is a collective even with whole weights
    (expert parallelism), so the rollout runs in lockstep; ``dtype``: the dtype of the rollout's GEMMs
    (None: the weights' own; :func:`low_precision_gemms`), its completions then carrying their sampling log-probs;
    ``record``: they carry them in any dtype (GRPO's ``ratio/*`` spread); ``routing``: a
    :class:`~qwenkit.model.routing_replay.RoutingReplay` on the model's routers, each completion then carrying the
    experts its prompt's and tokens' forwards were routed to (``grpo.routing_replay``).
    """

    def __init__(self, sampling: Sampling, num_generations: int, batch_size: int = 0, where: str = "auto",
                 collective: bool = False, dtype: torch.dtype | None = None, record: bool = False,
                 routing: RoutingReplay | None = None):  # fmt: skip
        if sampling.temperature <= 0:
            raise ValueError("rollouts sample: temperature must be > 0")
        if where not in WHERE:
            raise ValueError(f"rollouts come from one of {WHERE}, got {where!r}")
        self.sampling, self.num_generations, self.batch_size = sampling, num_generations, batch_size
        self.where = "lockstep" if collective else where
        self.dtype, self.record, self.routing = dtype, record or dtype is not None, routing
        self.routed: list[torch.Tensor] | None = None  # with routing: each row's [layers, prompt + new, k], of the last call
        self.sampled_logps: list[list[float]] | None = None  # with dtype: each row's sampling log-probs, of the last call
        self.chosen: tuple[str, str] | None = None  # (gather | lockstep, why) of the last rollout

    def __call__(self, model: nn.Module, dataset, indices: list[int], draw: int) -> list[Completion]:
        tok = dataset.processor.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")
        asked = [dataset.prompt(i) for i in indices]
        keys = [(k, g) for k in range(len(indices)) for g in range(self.num_generations)]  # [position in indices, g]
        seeds = [completion_seed(self.sampling.seed, draw, indices[k], g) for k, g in keys]
        tokens = self.sample_rows(model, [asked[k][0] for k, _ in keys], seeds, end, dataset.processor.pad_token_id,
                                  media_tokens(dataset.processor))  # fmt: skip
        done = []
        for r, ((k, _), new) in enumerate(zip(keys, tokens)):
            new, text, truncated = completion(tok, new, end)
            logps = self.sampled_logps[r][: len(new)] if self.sampled_logps is not None else None
            routed = self.routed[r][:, : asked[k][0]["input_ids"].shape[1] + len(new)] if self.routed is not None else None
            done.append(Completion(indices[k], asked[k][0], new, text, truncated, asked[k][1].reference,
                                   dataset.columns(indices[k]), logps, routing=routed))  # fmt: skip
        return done

    def begin(self, model: nn.Module) -> None:
        """An agentic rollout starts (:mod:`qwenkit.engine.rollouts.agentic`): nothing to do, the weights are the model's."""

    @staticmethod
    def turn_prompt(trajectory, dataset) -> dict[str, torch.Tensor]:
        """An agentic trajectory's next turn as :meth:`sample_rows` takes a prompt: its prompt and tokens so far."""
        return trajectory.inputs(dataset.processor.image_token_id)

    @torch.no_grad()
    def sample_rows(self, model: nn.Module, prompts: list[dict], seeds: list[int], end: int, pad: int,
                    suppress: list[int], max_new_tokens: int | None = None) -> list[list[int]]:  # fmt: skip
        """The new tokens of each ``[1, S]`` prompt of ``prompts``, sampled from ``seeds``' generators (one a
        row), ended by ``end`` (then ``pad``) or ``max_new_tokens`` (None: ``grpo.max_new_tokens``; an agentic
        trajectory's turn: what its budget leaves); ``suppress``: tokens never drawn; no prompt: every
        collective of a call still taken (a rank whose trajectories all ended). With
        ``dtype`` or ``record``, ``self.sampled_logps`` holds each row's sampling log-prob of every token generated
        (pads included); with ``routing``, ``self.routed`` each row's experts (prompt and tokens generated)."""
        most = max_new_tokens or self.sampling.max_new_tokens
        config = generation_config(Sampling(most), end, pad)  # greedy: RowSampler draws
        config.suppress_tokens = suppress
        device = next(model.parameters()).device
        rows = sorted(range(len(prompts)), key=lambda r: -prompts[r]["input_ids"].shape[1])  # longest first, stable
        size = self.batch_size or max(len(rows), 1)
        batches = [rows[start : start + size] for start in range(0, len(rows), size)]
        longest = max((p["input_ids"].shape[1] for p in prompts), default=1)
        self.chosen = choose_generation(self.where, model, Sampling(most, size), longest, device, self.dtype)
        gathered = self.chosen[0] == "gather"
        in_step = not gathered or columns.sharded(model)  # the tables' lookups are collectives, whole weights or not
        if gathered and in_step:
            self.chosen = ("gather", f"{self.chosen[1]}; in step: the column-sharded tables stay split, each lookup a collective")
        if in_step and dist.is_initialized() and dist.get_world_size() > 1:
            calls = torch.tensor([len(batches)], device=device)
            dist.all_reduce(calls, op=dist.ReduceOp.MAX)  # every rank makes as many lockstep calls
            batches += [[] for _ in range(int(calls.item()) - len(batches))]  # a dummy call each, dropped
        tokens: dict[int, list[int]] = {}
        logps: dict[int, list[float]] = {}
        routed: dict[int, torch.Tensor] = {}
        was_training = model.training
        model.eval()
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.random.fork_rng(devices=[device] if device.type != "cpu" else []))
                if gathered:
                    stack.enter_context(unsharded(model))
                if self.dtype is not None:  # gathered: each weight cast once for the rollout
                    stack.enter_context(low_precision_gemms(model, self.dtype, once=gathered))
                step = stack.enter_context(lockstep(model, synced=None if in_step else False))
                for chunk in batches:
                    padded = left_pad([prompts[r] for r in chunk] or [dummy_prompt(pad)], pad)
                    inputs = prompt_inputs(model, padded, device)
                    if not chunk:
                        step(inputs, one_token(config))
                        continue
                    sampler = RowSampler([seeds[r] for r in chunk], self.sampling.temperature, self.sampling.top_p,
                                         record=self.record)  # fmt: skip
                    width = inputs["input_ids"].shape[1]
                    with self.routing.recording() if self.routing else contextlib.nullcontext() as calls:
                        out = step(inputs, config, logits_processor=[sampler])[:, width:]  # [B, new]
                    tokens.update(zip(chunk, out.tolist()))
                    if calls is not None:
                        pads = [width - prompts[r]["input_ids"].shape[1] for r in chunk]
                        routed.update(zip(chunk, decoded_rows(calls, len(chunk), width, pads, [out.shape[1]] * len(chunk))))
                    if sampler.logps is not None:
                        logps.update(zip(chunk, torch.stack(sampler.logps, dim=1).cpu().tolist()))  # [B, new]
        finally:
            model.train(was_training)
        self.sampled_logps = [logps[r] for r in range(len(prompts))] if self.record else None
        self.routed = [routed[r] for r in range(len(prompts))] if self.routing else None
        return [tokens[r] for r in range(len(prompts))]


@contextlib.contextmanager
def low_precision_gemms(model: nn.Module, dtype: torch.dtype, once: bool):
    """Every ``nn.Linear`` of ``model`` (LoRA's included) computing in ``dtype`` for the block: its input, weight
    and bias cast to ``dtype``, its output back to the input's dtype; everything else (norms, attention and its
    KV cache, convolutions, fused experts) as before. ``once``: each weight cast at its first call and kept for
    the block (the weights whole and unchanging: inside :func:`~qwenkit.distributed.unshard.unsharded`), else
    at every call (a sharded unit gathers its weights anew at each forward). The modules' own forwards and
    parameters are untouched: the block only sets an instance ``forward`` on each, removed on leaving."""
    kept: dict[nn.Module, tuple] = {}

    def forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        cast = kept.get(module)
        if cast is None:
            cast = (module.weight.to(dtype), None if module.bias is None else module.bias.to(dtype))
            if once:
                kept[module] = cast
        return F.linear(x.to(dtype), *cast).to(x.dtype)

    linears = [m for m in model.modules()
               if isinstance(m, nn.Linear) and m.weight.dtype != dtype and "forward" not in vars(m)]  # fmt: skip
    for module in linears:
        module.forward = functools.partial(forward, module)
    try:
        yield model
    finally:
        for module in linears:
            del module.forward


__all__ = ["WHERE", "HfRollouts", "low_precision_gemms"]
