"""GRPO (``train.objective: grpo``): rollouts of the current policy, scored by rewards, one objective among peers.

One rollout, every ``grpo.num_iterations`` optimizer steps (:meth:`GrpoObjective.micro_batches`):

1. this rank's ``train.grad_accum`` batches of ``train.micro_batch_size`` rows from the sampler
   (saved with checkpoints: a resumed run draws the rows the uninterrupted one would);
2. ``grpo.num_generations`` completions of each row's prompt from the policy, its weights gathered
   once for the rollout and every completion of the rank batched (:mod:`qwenkit.engine.rollouts.hf`,
   each completion seeded by ``(train.seed, epoch, row, g)``); ``rollout_time`` is its seconds;
3. the rewards of every completion (:mod:`qwenkit.engine.objectives.rewards`), gathered from every rank, and
   the group advantages (:func:`qwenkit.model.losses.policy.group_advantages`);
4. per micro-batch (one batch of rows' completions): the reference's per-token log-probs
   (``grpo.beta > 0``: the policy with its LoRA adapters disabled, or a frozen sharded copy of the
   starting weights as DPO's) and, with ``num_iterations > 1``, the rollout policy's (``old``).

Then each micro-batch's loss (:class:`qwenkit.model.losses.policy.GrpoLoss`) on the policy's per-token
log-probs from the chunked head (:meth:`~qwenkit.model.families.chunked.ChunkLossMixin.token_logps`: no
``[B, S, V]`` logits), normalised by the step's global completions and completion tokens; its entropies
pick the tokens that carry the loss under ``grpo.top_entropy_quantile < 1`` (the micro-batch's threshold over every rank). Every
log-prob (old, reference, current) and the entropy are those of the distribution the rollout sampled
(:meth:`GrpoObjective.logps`): the logits divided by ``grpo.temperature`` (as TRL), the media tokens
a rollout never draws (:func:`~qwenkit.engine.rollouts.completion.media_tokens`) banned, so a token's
log-prob is the one HF ``generate`` (and vLLM) sampled it with, not ``-log(1 - their mass)`` below. Metrics are TRL's names,
summed by name over the ranks (:mod:`qwenkit.engine.objectives.grpo_metrics`).

**The completions file**, ``metrics/completions.jsonl`` beside the metrics: at each step the trainer
logs (``train.log_every``, and an invocation's last step; :meth:`GrpoObjective.log`), rank 0 appends a
sample of the completions of that step's rollout: its first :data:`~qwenkit.engine.objectives.completions.SAMPLE_GROUPS` groups (prompts)
with all their completions, each a line ``{"step", "k", "rollout", "epoch", "index", "completion",
"reference", "rewards": {name: value}, "reward", "advantage", "truncated"}`` (``k``: the line's
place in its step's write, 0 first; ``index``: the prompt's dataset row); an agentic trajectory's line
(``grpo.tools`` / ``grpo.environment``: :mod:`qwenkit.engine.rollouts.agentic`, whose ``tools/*`` metrics join
the rollout's) also holds its ``messages``, ``model_tokens``, ``tool_tokens`` and ``turns``. A resumed run appends
too, as the metrics files do: a step run again after a crash is written again, and
:func:`~qwenkit.engine.objectives.completions.read_completions` keeps the last write of each step.

**Resume in the middle of a cycle** (``num_iterations > 1``): the cached rollout (this rank's
micro-batches with their old and reference log-probs and advantages, the rollout's metrics, rank
0's sample) is saved with a checkpoint taken in the middle of a cycle (:meth:`GrpoObjective.state_dict`;
at a cycle's end, always with ``num_iterations: 1``, the next step rolls out anew and only the count
is saved), so a resumed run trains on exactly the rollout the uninterrupted one did. A checkpoint of
another number of ranks holds other ranks' caches, and one whose rollout-shaping settings
(:data:`ROLLOUT_SETTINGS`: group size, cycle length, completion length, sampling, rewards, the
reference, the micro-batches) differ from this run's was rolled out for another run: in both cases
the resumed run rolls out again at its first step, as the next cycle, and says so; it never trains
on a rollout of other settings.

**Routing replay and sequence parallelism.** With ``grpo.routing_replay`` (a MoE policy) the hf rollouts record
each router's experts and the policy's old and current log-probs replay them (:mod:`qwenkit.model.routing_replay`);
the trainer-to-sampler ratio's spread at a rollout's first step is logged either way (``ratio/*``,
:class:`~qwenkit.engine.objectives.grpo_metrics.RatioSpread`). Under ``parallel.sp_size > 1`` an SP group trains on
its first rank's rollout (broadcast), its log-probs come from the ranks' slices gathered
(:func:`qwenkit.model.parallel.token_logps_slice`), and every rank takes the whole loss, valued at its share.

**vLLM rollouts** (``grpo.rollout_engine: vllm``, :mod:`qwenkit.engine.rollouts.vllm`; with tools, each turn of
the trajectories: :mod:`qwenkit.engine.rollouts.vllm_turns`): the
completions come from this rank's colocated vLLM engine, the policy's weights pushed to it first. vLLM's
sampling log-probs differ from the trainer's (other kernels, other sums), and so do those of HF rollouts
in a lower precision (``grpo.rollout_dtype``: autocast, :mod:`qwenkit.engine.rollouts.hf`), so with
``grpo.vllm_importance_sampling_correction`` each micro-batch also gets the trainer's log-probs of the
rollout (``old``, computed whatever ``num_iterations``) and the truncated importance-sampling weights
``exp(old - vLLM's)`` (:func:`qwenkit.model.losses.policy.vllm_importance_weights`) that scale its
per-token loss, logged as TRL names them: ``sampling/sampling_logp_difference/{mean,max}`` and
``sampling/importance_sampling_ratio/{min,mean,max}`` (means over every rank's completion tokens).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method

from qwenkit.engine.generation.eval_command import evaluate_generations
from qwenkit.engine.generation.evaluate import Evaluator
from qwenkit.engine.generation.sampling import Sampling
from qwenkit.engine.generation.vllm_engine import spec_of
from qwenkit.engine.objective import Objective
from qwenkit.engine.objectives import completions, dynamic_sampling, grpo_metrics
from qwenkit.engine.objectives import rewards as reward_fns
from qwenkit.engine.objectives.completions import SAMPLE_FILE
from qwenkit.engine.objectives.dynamic_sampling import Round
from qwenkit.engine.objectives.grpo_metrics import ImportanceStats, RatioSpread, StepMetrics
from qwenkit.engine.rollouts import agentic
from qwenkit.engine.rollouts.agentic import AgenticRollouts
from qwenkit.engine.rollouts.completion import (
    Rollouts,
    completion_mask,
    media_tokens,
    sampler_logps,
    training_batch,
)
from qwenkit.engine.rollouts.hf import HfRollouts
from qwenkit.engine.rollouts.tools import Toolbox
from qwenkit.engine.rollouts.vllm import VllmRollouts
from qwenkit.engine.rollouts.vllm_turns import VllmTurns
from qwenkit.engine.run.build import reference_model
from qwenkit.model import lora
from qwenkit.model.families import registry as families
from qwenkit.model.losses.policy import GrpoLoss, StepTotals, group_advantages, vllm_importance_weights
from qwenkit.model.routing_replay import RoutingReplay
from qwenkit.rundir import RunDir

log = logging.getLogger(__name__)

# what the objective pops from a micro-batch
OWN_KEYS = ("advantages", "truncated", "old_logps", "ref_logps", "is_ratio", "sampling_logps", "routed_experts")
# what a cached rollout was made under: a mid-cycle resume under other values rolls out again
ROLLOUT_SETTINGS = ("grpo.num_generations", "grpo.num_iterations", "grpo.max_new_tokens", "grpo.temperature",
                    "grpo.top_p", "grpo.rollout_engine", "grpo.rollout_dtype", "grpo.rewards", "grpo.reward_weights",
                    "grpo.format_tags", "grpo.overlong_buffer", "grpo.scale_rewards", "grpo.mask_truncated_completions", "grpo.beta",
                    "grpo.dynamic_sampling", "grpo.max_resample_rounds", "grpo.tools", "grpo.environment",
                    "grpo.max_tool_calling_iterations", "grpo.max_trajectory_tokens", "grpo.routing_replay", "train.micro_batch_size",
                    "train.grad_accum", "data.packing", "train.seed")  # fmt: skip


def rollout_settings(cfg) -> dict:
    """The values of :data:`ROLLOUT_SETTINGS` in ``cfg``, by dotted key."""
    out = {}
    for key in ROLLOUT_SETTINGS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        out[key] = list(value) if isinstance(value, (list, tuple)) else value
    return out


def enable(model: nn.Module) -> nn.Module:
    """Let FSDP2's root hooks gather parameters around ``model.token_logps`` too."""
    register_fsdp_forward_method(model, "token_logps")
    return model


class GrpoObjective(Objective):
    """The trainer's hooks for ``train.objective: grpo`` (see :mod:`qwenkit.engine.objective`)."""

    def __init__(self, cfg, rt, bundle, box_units: str, reference: nn.Module | str | None, evaluator=None, out_dir=None,
                 model_dir: str | None = None, routing: RoutingReplay | None = None, sp=None):  # fmt: skip
        grpo = cfg.grpo
        self.grpo, self.rt, self.bundle, self.reference, self.evaluator = grpo, rt, bundle, reference, evaluator
        self.routing = routing  # grpo.routing_replay: the policy's routers, recorded in rollouts, replayed in training
        self.sp = sp if sp is not None and sp.size > 1 else None  # a sequence-parallel group: one rollout, sliced forwards
        self.loss_fn = GrpoLoss(grpo, counts_tokens=self.sp is None or self.sp.rank == 0)  # the entropy threshold's
        self.rewards = reward_fns.resolve(grpo.rewards, box_units, tuple(grpo.format_tags), grpo.max_new_tokens,
                                          grpo.overlong_buffer)  # fmt: skip
        self.settings, self.packing = rollout_settings(cfg), cfg.data.packing  # packing: the micro-batches' layout
        self.banned = media_tokens(bundle.dataset.processor)  # what no rollout draws: no log-prob counts them
        sampling = Sampling(grpo.max_new_tokens, temperature=grpo.temperature, top_p=grpo.top_p, seed=cfg.train.seed)
        agentic = bool(grpo.tools or grpo.environment)  # trajectories: generate, call the tools, generate again
        if grpo.rollout_engine == "vllm":  # the engine the evaluator shares (spec_of: one per rank)
            spec = spec_of(cfg, bundle.dataset.processor, model_dir)
            self.rollouts: Rollouts = (VllmTurns if agentic else VllmRollouts)(spec, sampling, grpo.num_generations)
        else:  # expert parallelism's all-to-all makes every forward collective: lockstep even with whole weights
            dtype = getattr(torch, grpo.rollout_dtype) if grpo.rollout_dtype else None
            self.rollouts = HfRollouts(sampling, grpo.num_generations, grpo.rollout_batch_size,
                                       collective=cfg.parallel.ep_size > 1, dtype=dtype, record=True,
                                       routing=routing)  # fmt: skip
        if agentic:
            self.rollouts = AgenticRollouts(self.rollouts, Toolbox(grpo.tools, grpo.environment, grpo.tool_timeout_s),
                                            grpo.max_tool_calling_iterations, grpo.max_trajectory_tokens)  # fmt: skip
        # vLLM's and a lower-precision rollout's sampling log-probs are corrected for (module docstring)
        other = grpo.rollout_engine == "vllm" or grpo.rollout_dtype is not None
        self.corrects = other and grpo.vllm_importance_sampling_correction
        self.rollout_time = 0.0  # seconds this step spent rolling out (0 on a step that reuses the rollout)
        self.rows = iter(bundle.sampler)  # the sampler moves as rows are drawn: checkpoints save where
        self.cached: list[dict] = []  # the rollout's micro-batches, for num_iterations steps
        self.uses = 0  # steps trained so far on rollouts (a rollout every num_iterations of them)
        self.rollout_metrics: dict[str, float] = {}  # the last rollout's rewards and lengths (every rank)
        self.sample: list[dict] = []  # rank 0: the completions file's lines of the last rollout, without their step
        self.sample_file = Path(out_dir) / "metrics" / SAMPLE_FILE if out_dir is not None and rt.rank == 0 else None
        self.out_dir = out_dir  # the run folder: a failed reward's records go there (rewards.stopped)

    @classmethod
    def build(cls, cfg, rt, model: nn.Module, bundle, sp=None, out_dir=None) -> GrpoObjective:
        """The model is sharded and holds its starting weights: a frozen copy of them is the reference."""
        enable(model)
        reference = cls.reference_of(cfg, rt, model)
        evaluator = None
        if bundle.eval_dataset is not None:
            evaluator = Evaluator(cfg, bundle.eval_dataset, bundle.collator, rt.rank, rt.world_size, rt.device, out_dir,
                                  sp=sp)  # an SP group evaluates the same rows, each rank its slice
        family = families.of_model(model)  # the family the model was built as (registry.build)
        routing = RoutingReplay(model, family.routers) if cfg.grpo.routing_replay else None
        return cls(cfg, rt, bundle, family.box_units, reference, evaluator, out_dir, model.name_or_path, routing, sp)

    @staticmethod
    def reference_of(cfg, rt, model: nn.Module) -> nn.Module | str | None:
        """What scores the rollouts' tokens besides the policy (their ``ref_logps``): GRPO's reference when ``grpo.beta > 0``."""
        if cfg.grpo.beta <= 0:
            return None
        return "adapters" if lora.has_adapters(model) else enable(reference_model(cfg, rt, model))

    # --- one rollout ------------------------------------------------------------------------

    def micro_batches(self, model: nn.Module, batches, count: int) -> list[dict]:
        """A new rollout every ``grpo.num_iterations`` steps (module docstring), else the last one again."""
        self.rollout_time = 0.0  # the seconds of this step's rollouts (every round of dynamic sampling)
        if self.uses % self.grpo.num_iterations == 0:
            self.cached = self._rollout(model, count)
        self.uses += 1
        return [dict(b) for b in self.cached]  # the trainer pops its counts from these

    def _draw(self, model: nn.Module, count: int) -> Round:
        """``count`` batches of rows from the sampler, their completions and rewards."""
        epoch = self.bundle.sampler.epoch
        groups = [next(self.rows) for _ in range(count)]  # [count][micro_batch_size] dataset rows
        start = time.perf_counter()
        done = self.rollouts(model, self.bundle.dataset, [i for g in groups for i in g], epoch)
        if self.sp is not None:  # the group trains on one rollout: its first rank's, whatever the kernels' noise
            shared = [done]
            dist.broadcast_object_list(shared, src=self.rt.rank - self.sp.rank, group=self.sp.group)
            done = shared[0]
        self.rollout_time += time.perf_counter() - start
        names = [f"row {c.index}" for c in done]
        failure = None
        try:
            per, total = reward_fns.score(self.rewards, self.grpo.reward_weights, [c.text for c in done],
                                          [c.reference for c in done], [c.row | {"completion_ids": c.tokens} for c in done],
                                          names)  # fmt: skip
        except reward_fns.RewardError as e:
            c = done[e.record.pop("position")]
            failure = {**e.record, "index": c.index, "epoch": epoch, "where": str(self.bundle.dataset.conversation(c.index).where)}
        self._agree_on_rewards(failure)
        return Round(done, per, total, [epoch] * len(done))

    def _rollout(self, model: nn.Module, count: int) -> list[dict]:
        if self.grpo.dynamic_sampling:  # uninformative groups dropped, more prompts drawn (DAPO)
            drawn, resampled = dynamic_sampling.fill(lambda: self._draw(model, count), self.grpo.num_generations,
                                                     self.grpo.max_resample_rounds, self.rt.device)  # fmt: skip
        else:
            drawn, resampled = self._draw(model, count), {}
        if self.uses == 0 and self.rt.rank == 0 and getattr(self.rollouts, "chosen", None):
            log.info("grpo rollouts: %s (%s)", *self.rollouts.chosen)
        done, per, total = drawn.done, drawn.per, drawn.total
        truncated = torch.tensor([c.truncated for c in done])
        columns = {f"rewards/{name}": per[:, k] for k, name in enumerate(self.rewards)}
        columns |= {"reward": total, "length": torch.tensor([float(c.model_tokens) for c in done]),
                    "truncated": truncated.float()}  # fmt: skip
        if isinstance(self.rollouts, AgenticRollouts):
            columns |= {k: torch.tensor([float(c.trajectory[k]) for c in done]) for k in agentic.STATS}
        everyone = grpo_metrics.gather_named(columns, self.rt.device)  # name -> [every rank's completions]
        rank = self.rt.rank
        n = len(done)
        adv, zero = self.advantages(everyone["reward"])
        self.rollout_metrics = grpo_metrics.rollout_metrics(everyone, zero, self.rewards) | resampled
        mine = adv[rank * n : (rank + 1) * n]
        if self.sample_file is not None:
            self.sample = completions.sample(done, per, total, mine, drawn.epochs, list(self.rewards), self.grpo.num_generations,
                                             self.uses // self.grpo.num_iterations)  # fmt: skip
        size = n // count
        micro = []
        stats = ImportanceStats()  # importance sampling over the rollout
        for k in range(count):
            part = slice(k * size, (k + 1) * size)
            batch = training_batch(done[part], self.bundle.dataset.processor.pad_token_id, self.packing)
            kept = self.grpo.mask_truncated_completions
            valid = completion_mask(batch) & ~(truncated[part, None] & kept)
            batch |= {"num_items": valid.sum(), "num_samples": torch.tensor(size),
                      "advantages": mine[part], "truncated": truncated[part]}  # fmt: skip
            if all(c.sampling_logps is not None for c in done[part]):  # the ratio's spread (RatioSpread)
                batch["sampling_logps"] = sampler_logps(batch, done[part])
            batch |= self._fixed_logps(model, batch)
            if self.corrects:
                batch |= self._importance(batch, stats)
            micro.append(batch)
        if self.corrects:
            self.rollout_metrics |= stats.metrics(self.rt.device)
        return micro

    def advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's completions' advantages and whether their group's rewards are all equal."""
        return group_advantages(rewards, self.grpo.num_generations, self.grpo.scale_rewards)

    def _agree_on_rewards(self, failure: dict | None) -> None:
        """Collective: a reward that failed on any rank stops every rank here, at the same point (one
        all-reduce of a flag), rather than leaving the others in the gather with a lost peer: every rank
        raises :func:`qwenkit.engine.objectives.rewards.stopped`'s error, rank 0 writes the records."""
        failed = torch.tensor([failure is not None], dtype=torch.int32, device=self.rt.device)
        several = dist.is_initialized() and dist.get_world_size() > 1
        if several:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if not failed.item():
            return
        records = [failure]
        if several:
            records = [None] * dist.get_world_size()
            dist.all_gather_object(records, failure)
        path = RunDir(self.out_dir).reward_failure if self.out_dir is not None else None
        raise reward_fns.stopped(records, self.uses + 1, path, write=self.rt.rank == 0)

    @torch.no_grad()
    def _fixed_logps(self, model: nn.Module, batch: dict) -> dict:
        """The rollout policy's (``num_iterations > 1``) and the reference's (``beta > 0``) per-token log-probs."""
        inputs = {k: v.to(self.rt.device) for k, v in batch.items() if k not in (*OWN_KEYS, "num_items", "num_samples")}
        out = {}
        if self.grpo.num_iterations > 1 or self.corrects:
            out["old_logps"] = self.logps(model, inputs, routed=batch.get("routed_experts"))[0].cpu()
        if self.reference == "adapters":
            with lora.adapters_disabled(model):
                out["ref_logps"] = self.logps(model, inputs)[0].cpu()
        elif self.reference is not None:
            out["ref_logps"] = self.logps(self.reference, inputs)[0].cpu()
        return out

    def logps(self, model: nn.Module, batch: dict, entropy: bool = False,
              routed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """``model``'s per-token log-probs (and entropies) of ``batch``'s completions under the distribution
        the rollout sampled: over ``grpo.temperature``, the media tokens banned (module docstring); ``routed``:
        the policy's routers forced to the rollout's experts (``grpo.routing_replay``)."""
        replay = self.routing.replaying(routed) if self.routing is not None else contextlib.nullcontext()
        with replay:
            return model.token_logps(**batch, entropy=entropy, temperature=self.grpo.temperature, banned=self.banned)

    def _importance(self, batch: dict, stats: ImportanceStats) -> dict:
        """The micro-batch's vLLM importance-sampling weights (module docstring), its statistics added to
        ``stats``; ``old`` stays only for ``num_iterations > 1`` (else the policy's own log-probs are the
        ratio's denominator, as without vLLM)."""
        g = self.grpo
        old = batch["old_logps"] if g.num_iterations > 1 else batch.pop("old_logps")  # [B, S]
        mask = completion_mask(batch)  # [B, S] the completion tokens, in order
        sampling = batch["sampling_logps"]
        ratio = vllm_importance_weights(old, sampling, mask.to(old.dtype), g.vllm_importance_sampling_mode,
                                        g.vllm_importance_sampling_clip_min, g.vllm_importance_sampling_clip_max)  # fmt: skip
        kept = ratio[mask] if ratio.shape[1] > 1 else ratio.flatten()  # per token, or per completion
        stats.add((old - sampling).abs()[mask], kept)
        return {"is_ratio": ratio}

    # --- the step ---------------------------------------------------------------------------

    def begin(self, micro: list[dict], counts: torch.Tensor) -> None:
        """Pop the rollout's keys; the step's global completions, completion tokens and micro-batches."""
        self.queue = [{k: b.pop(k) for k in OWN_KEYS if k in b} for b in micro]
        groups = self.rt.world_size // (self.sp.size if self.sp is not None else 1)  # the data-parallel ranks
        self.totals = StepTotals(completions=counts[1], tokens=counts[0], micro_batches=len(micro) * groups)
        self.step_metrics = StepMetrics(self.rt.device)
        # a rollout's first step: the policy is the sampler's, so exp(logps - sampler's) is their mismatch alone
        self.spread = RatioSpread(self.rt.device) if (self.uses - 1) % self.grpo.num_iterations == 0 else None

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        own = {k: v.to(self.rt.device) for k, v in self.queue.pop(0).items()}
        logps, entropies = self.logps(model, batch, entropy=True, routed=own.get("routed_experts"))
        mask = completion_mask(batch)  # [B, S] the completion tokens
        if self.spread is not None and "sampling_logps" in own:
            self.spread.add(logps.detach(), own["sampling_logps"], mask)
        terms = self.loss_fn(logps, own["advantages"], mask, self.totals, old=own.get("old_logps"),
                             ref=own.get("ref_logps"), truncated=own["truncated"], is_ratio=own.get("is_ratio"),
                             entropies=entropies)  # fmt: skip
        self.step_metrics.add(terms, entropies)
        if self.sp is not None:  # every rank of the group takes the whole loss, its gradient through its slice only
            return self.sp.share(terms.loss)  # the value: its share
        return terms.loss

    def metrics(self) -> dict[str, float]:
        """TRL's names: the rollout's reward and completion metrics, the step's KL, entropy and clipping."""
        out = dict(self.rollout_metrics) | self.step_metrics.reduce(self.grpo.beta)
        if self.spread is not None:
            out |= self.spread.reduce()
        out["rollout_time"] = self.rollout_time
        return out

    def log(self, step: int) -> None:
        """A logged step: rank 0 appends the sample of this step's rollout to the completions file."""
        if self.sample_file is not None and self.sample:
            completions.append(self.sample_file, step, self.sample)

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's cached rollout when a resume needs it: in the middle of a ``num_iterations`` cycle.
        At a cycle's end (always, with ``num_iterations: 1``) the next step rolls out anew: only the count."""
        if self.uses % self.grpo.num_iterations == 0:
            return {"uses": self.uses}
        return {"uses": self.uses, "cached": self.cached, "rollout_metrics": self.rollout_metrics, "sample": self.sample,
                "settings": self.settings}  # fmt: skip

    def load_state_dict(self, state: dict, same_ranks: bool = True) -> None:
        """The cached rollout back; of another rank count (``state`` is its rank 0's) or of other
        rollout settings: roll out again, as the next cycle (the rollout count goes on)."""
        n = self.grpo.num_iterations
        changed = [k for k, v in state.get("settings", self.settings).items() if self.settings.get(k) != v]
        if "cached" in state and (not same_ranks or changed):
            why = ("a checkpoint of another number of ranks: its cached rollouts are those ranks' own" if not same_ranks
                   else "a rollout made under other settings (" + ", ".join(
                       f"{k}={state['settings'][k]!r}, now {self.settings.get(k)!r}" for k in changed) + ")")  # fmt: skip
            if self.rt.rank == 0:
                log.warning("resumed in the middle of a grpo.num_iterations cycle from %s, so this run rolls out "
                            "again at its first step", why)  # fmt: skip
            self.uses = -(-state["uses"] // n) * n  # the next cycle's start
            return
        self.uses = state["uses"]
        if "cached" in state:
            self.cached, self.rollout_metrics, self.sample = state["cached"], state["rollout_metrics"], state["sample"]

    evaluate_cli = staticmethod(evaluate_generations)  # answer metrics of the prompts' generations (eval loss where rows have replies)

