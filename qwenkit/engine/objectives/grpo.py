"""GRPO (``train.objective: grpo``): rollouts of the current policy, scored by rewards, one objective among peers.

One rollout, every ``grpo.num_iterations`` optimizer steps (:meth:`GrpoObjective.micro_batches`):

1. this rank's ``train.grad_accum`` batches of ``train.micro_batch_size`` rows from the sampler
   (saved with checkpoints: a resumed run draws the rows the uninterrupted one would);
2. ``grpo.num_generations`` completions of each row's prompt from the sharded policy
   (:mod:`qwenkit.engine.objectives.rollout`, seeded by ``(train.seed, epoch, row)``);
3. the rewards of every completion (:mod:`qwenkit.engine.objectives.rewards`), gathered from every rank, and
   the group advantages (:func:`qwenkit.model.grpo_loss.group_advantages`);
4. per micro-batch (one batch of rows' completions): the reference's per-token log-probs
   (``grpo.beta > 0``: the policy with its LoRA adapters disabled, or a frozen sharded copy of the
   starting weights as DPO's) and, with ``num_iterations > 1``, the rollout policy's (``old``).

Then each micro-batch's loss (:class:`qwenkit.model.grpo_loss.GrpoLoss`) on the policy's per-token
log-probs from the chunked head (:meth:`~qwenkit.model.chunked.ChunkLossMixin.token_logps`: no
``[B, S, V]`` logits), normalised by the step's global completions and completion tokens. Metrics
are TRL's names.

**The completions file**, ``metrics/completions.jsonl`` beside the metrics: at each step the trainer
logs (``train.log_every``, and an invocation's last step; :meth:`GrpoObjective.log`), rank 0 appends a
sample of the completions of that step's rollout: its first :data:`SAMPLE_GROUPS` groups (prompts)
with all their completions, each a line ``{"step", "k", "rollout", "epoch", "index", "completion",
"reference", "rewards": {name: value}, "reward", "advantage", "truncated"}`` (``k``: the line's
place in its step's write, 0 first; ``index``: the prompt's dataset row). A resumed run appends
too, as the metrics files do: a step run again after a crash is written again, and
:func:`read_completions` keeps the last write of each step.

**Resume in the middle of a cycle** (``num_iterations > 1``): the cached rollout (this rank's
micro-batches with their old and reference log-probs and advantages, the rollout's metrics, rank
0's sample) is saved with a checkpoint taken in the middle of a cycle (:meth:`GrpoObjective.state_dict`;
at a cycle's end, always with ``num_iterations: 1``, the next step rolls out anew and only the count
is saved), so a resumed run trains on exactly the rollout the uninterrupted one did. A checkpoint of
another number of ranks holds other ranks' caches: the resumed run rolls out again at its first step,
as the next cycle, and says so.

Cannot: vLLM rollouts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method

from qwenkit.engine.generation.evaluate import Evaluator, evaluate_replies
from qwenkit.engine.generation.generate import Sampling
from qwenkit.engine.objective import Objective
from qwenkit.engine.objectives import rewards as reward_fns
from qwenkit.engine.objectives.dpo import frozen_copy
from qwenkit.engine.objectives.rollout import Completion, HfRollouts, training_batch
from qwenkit.model import family as families
from qwenkit.model import lora
from qwenkit.model.grpo_loss import GrpoLoss, StepTotals, group_advantages
from qwenkit.model.loss import IGNORE_INDEX, shift_labels
from qwenkit.records import read_jsonl

log = logging.getLogger(__name__)

OWN_KEYS = ("advantages", "truncated", "old_logps", "ref_logps")  # what the objective pops from a micro-batch
CLIP = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
SAMPLE_FILE = "completions.jsonl"  # beside the metrics: a sample of each logged step's completions (rank 0's)
SAMPLE_GROUPS = 8  # prompts of rank 0's rollout written per logged step, each with all its completions


def enable(model: nn.Module) -> nn.Module:
    """Let FSDP2's root hooks gather parameters around ``model.token_logps`` too."""
    register_fsdp_forward_method(model, "token_logps")
    return model


class GrpoObjective(Objective):
    """The trainer's hooks for ``train.objective: grpo`` (see :mod:`qwenkit.engine.objective`)."""

    def __init__(self, cfg, rt, bundle, box_units: str, reference: nn.Module | str | None, evaluator=None, out_dir=None):
        grpo = cfg.grpo
        self.grpo, self.rt, self.bundle, self.reference, self.evaluator = grpo, rt, bundle, reference, evaluator
        self.loss_fn = GrpoLoss(grpo)
        self.rewards = reward_fns.resolve(grpo.rewards, box_units, tuple(grpo.format_tags))
        sampling = Sampling(grpo.max_new_tokens, grpo.num_generations, grpo.temperature, grpo.top_p, cfg.train.seed)
        self.rollouts = HfRollouts(sampling, grpo.num_generations)
        self.rows = iter(bundle.sampler)  # the sampler moves as rows are drawn: checkpoints save where
        self.cached: list[dict] = []  # the rollout's micro-batches, for num_iterations steps
        self.uses = 0  # steps trained so far on rollouts (a rollout every num_iterations of them)
        self.rollout_metrics: dict[str, float] = {}  # the last rollout's rewards and lengths (every rank)
        self.sample: list[dict] = []  # rank 0: the completions file's lines of the last rollout, without their step
        self.sample_file = Path(out_dir) / "metrics" / SAMPLE_FILE if out_dir is not None and rt.rank == 0 else None

    @classmethod
    def build(cls, cfg, rt, model: nn.Module, bundle, sp=None, out_dir=None) -> GrpoObjective:
        """The model is sharded and holds its starting weights: a frozen copy of them is the reference."""
        enable(model)
        reference = None
        if cfg.grpo.beta > 0:
            reference = "adapters" if lora.has_adapters(model) else enable(frozen_copy(cfg, rt, model))
        evaluator = None
        if bundle.eval_dataset is not None:
            evaluator = Evaluator(cfg, bundle.eval_dataset, bundle.collator, rt.rank, rt.world_size, rt.device, out_dir)
        box_units = families.of_model(model).box_units  # the family the model was built as (registry.build)
        return cls(cfg, rt, bundle, box_units, reference, evaluator, out_dir)

    # --- one rollout ------------------------------------------------------------------------

    def micro_batches(self, model: nn.Module, batches, count: int) -> list[dict]:
        """A new rollout every ``grpo.num_iterations`` steps (module docstring), else the last one again."""
        if self.uses % self.grpo.num_iterations == 0:
            self.cached = self._rollout(model, count)
        self.uses += 1
        return [dict(b) for b in self.cached]  # the trainer pops its counts from these

    def _rollout(self, model: nn.Module, count: int) -> list[dict]:
        sampler = self.bundle.sampler
        epoch = sampler.epoch
        groups = [next(self.rows) for _ in range(count)]  # [count][micro_batch_size] dataset rows
        done = self.rollouts(model, self.bundle.dataset, [i for g in groups for i in g], epoch)
        names = [f"row {c.index}" for c in done]
        per, total = reward_fns.score(self.rewards, self.grpo.reward_weights, [c.text for c in done],
                                      [c.reference for c in done], [c.row for c in done], names)  # fmt: skip
        lengths = torch.tensor([len(c.tokens) for c in done], dtype=torch.float32)
        truncated = torch.tensor([c.truncated for c in done])
        mine_all = torch.cat([per, total[:, None], lengths[:, None], truncated[:, None].float()], dim=1)  # [n, K + 3]
        everyone = _gather(mine_all.to(self.rt.device)).cpu()
        rank = self.rt.rank
        n = len(done)
        adv, zero = group_advantages(everyone[:, -3], self.grpo.num_generations, self.grpo.scale_rewards)
        self.rollout_metrics = self._rollout_metrics(everyone, zero)
        mine = adv[rank * n : (rank + 1) * n]
        if self.sample_file is not None:
            self.sample = self._sample(done, per, total, mine, epoch)
        size = n // count
        micro = []
        for k in range(count):
            part = slice(k * size, (k + 1) * size)
            batch = training_batch(done[part], self.bundle.dataset.processor.pad_token_id)
            kept = self.grpo.mask_truncated_completions
            valid = (shift_labels(batch["labels"]) != IGNORE_INDEX) & ~(truncated[part, None] & kept)
            batch |= {"num_items": valid.sum(), "num_samples": torch.tensor(size),
                      "advantages": mine[part], "truncated": truncated[part]}  # fmt: skip
            batch |= self._fixed_logps(model, batch)
            micro.append(batch)
        return micro

    @torch.no_grad()
    def _fixed_logps(self, model: nn.Module, batch: dict) -> dict:
        """The rollout policy's (``num_iterations > 1``) and the reference's (``beta > 0``) per-token log-probs."""
        inputs = {k: v.to(self.rt.device) for k, v in batch.items() if k not in (*OWN_KEYS, "num_items", "num_samples")}
        out = {}
        if self.grpo.num_iterations > 1:
            out["old_logps"] = model.token_logps(**inputs)[0].cpu()
        if self.reference == "adapters":
            with lora.adapters_disabled(model):
                out["ref_logps"] = model.token_logps(**inputs)[0].cpu()
        elif self.reference is not None:
            out["ref_logps"] = self.reference.token_logps(**inputs)[0].cpu()
        return out

    # --- the step ---------------------------------------------------------------------------

    def begin(self, micro: list[dict], counts: torch.Tensor) -> None:
        """Pop the rollout's keys; the step's global completions, completion tokens and micro-batches."""
        self.queue = [{k: b.pop(k) for k in OWN_KEYS if k in b} for b in micro]
        self.totals = StepTotals(completions=counts[1], tokens=counts[0], micro_batches=len(micro) * self.rt.world_size)
        # [kl, entropy, low, high, region] sums, then their token (or completion) counts
        self.sums = torch.zeros(10, dtype=torch.float64, device=self.rt.device)
        # the lowest per-completion low-clip share and the highest high-clip share (TRL's low_min, high_max)
        self.extremes = torch.tensor([-torch.inf, -torch.inf], dtype=torch.float64, device=self.rt.device)

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        own = {k: v.to(self.rt.device) for k, v in self.queue.pop(0).items()}
        logps, entropies = model.token_logps(**batch, entropy=True)
        mask = shift_labels(batch["labels"]) != IGNORE_INDEX  # [B, S] the completion tokens
        terms = self.loss_fn(logps, own["advantages"], mask, self.totals, old=own.get("old_logps"),
                             ref=own.get("ref_logps"), truncated=own["truncated"])  # fmt: skip
        m = terms.mask
        # token level: the completion's tokens; sequence level: one ratio per completion (TRL's metrics)
        at = m if terms.ratio.shape[1] > 1 else torch.ones_like(terms.ratio)
        low, high = terms.low_clipped.to(at.dtype) * at, terms.high_clipped.to(at.dtype) * at
        kl = (terms.kl * m).sum() if terms.kl is not None else torch.zeros((), device=m.device)
        sums = [kl, (entropies * m).sum(), low.sum(), high.sum(), (low + high).sum(), m.sum(), m.sum(), *[at.sum()] * 3]
        self.sums += torch.stack(sums).to(self.sums)
        per_seq = at.sum(-1).clamp(min=1)
        seen = torch.stack([-(low.sum(-1) / per_seq).min(), (high.sum(-1) / per_seq).max()]).to(self.extremes)
        self.extremes = torch.maximum(self.extremes, seen)  # the low share's minimum as the maximum of its negative
        return terms.loss

    def metrics(self) -> dict[str, float]:
        """TRL's names: the rollout's reward and completion metrics, the step's KL, entropy and clipping."""
        dist.all_reduce(self.sums)
        dist.all_reduce(self.extremes, op=dist.ReduceOp.MAX)
        means = (self.sums[:5] / self.sums[5:].clamp(min=1)).tolist()
        out = dict(self.rollout_metrics)
        if self.grpo.beta > 0:
            out["kl"] = means[0]
        out["entropy"] = means[1]
        out.update(zip(CLIP, means[2:5]))
        out["clip_ratio/low_min"], out["clip_ratio/high_max"] = -self.extremes[0].item(), self.extremes[1].item()
        return out

    def _rollout_metrics(self, everyone: torch.Tensor, zero: torch.Tensor) -> dict[str, float]:
        per, total, lengths, truncated = everyone[:, :-3], everyone[:, -3], everyone[:, -2], everyone[:, -1]
        out = {"reward": total.mean().item(), "reward_std": total.std().item() if len(total) > 1 else 0.0}
        for k, name in enumerate(self.rewards):
            out[f"rewards/{name}/mean"] = per[:, k].mean().item()
            out[f"rewards/{name}/std"] = per[:, k].std().item() if len(per) > 1 else 0.0
        out["frac_reward_zero_std"] = zero.float().mean().item()
        out |= {"completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
                "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.mean().item()}  # fmt: skip
        return out

    def _sample(self, done: list[Completion], per: torch.Tensor, total: torch.Tensor, adv: torch.Tensor,
                epoch: int) -> list[dict]:  # fmt: skip
        """The completions file's lines of this rollout's first :data:`SAMPLE_GROUPS` groups (module docstring)."""
        kept = SAMPLE_GROUPS * self.grpo.num_generations
        rollout = self.uses // self.grpo.num_iterations
        return [{"rollout": rollout, "epoch": epoch, "index": c.index, "completion": c.text, "reference": c.reference,
                 "rewards": dict(zip(self.rewards, values)), "reward": r, "advantage": a, "truncated": c.truncated}
                for c, values, r, a in zip(done[:kept], per.tolist(), total.tolist(), adv.tolist())]  # fmt: skip

    def log(self, step: int) -> None:
        """A logged step: rank 0 appends the sample of this step's rollout to the completions file."""
        if self.sample_file is None or not self.sample:
            return
        self.sample_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.sample_file, "a") as f:
            f.writelines(json.dumps({"step": step, "k": k, **line}) + "\n" for k, line in enumerate(self.sample))

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's cached rollout when a resume needs it: in the middle of a ``num_iterations`` cycle.
        At a cycle's end (always, with ``num_iterations: 1``) the next step rolls out anew: only the count."""
        if self.uses % self.grpo.num_iterations == 0:
            return {"uses": self.uses}
        return {"uses": self.uses, "cached": self.cached, "rollout_metrics": self.rollout_metrics, "sample": self.sample}

    def load_state_dict(self, state: dict, same_ranks: bool = True) -> None:
        """The cached rollout back; of another rank count (``state`` is its rank 0's): roll out again,
        as the next cycle (the rollout count goes on)."""
        n = self.grpo.num_iterations
        if "cached" in state and not same_ranks:
            if self.rt.rank == 0:
                log.warning(
                    "resumed in the middle of a grpo.num_iterations=%d cycle from a checkpoint of another number of "
                    "ranks: its cached rollouts are those ranks' own, so this run rolls out again at its first step", n,
                )  # fmt: skip
            self.uses = -(-state["uses"] // n) * n  # the next cycle's start
            return
        self.uses = state["uses"]
        if "cached" in state:
            self.cached, self.rollout_metrics, self.sample = state["cached"], state["rollout_metrics"], state["sample"]

    evaluate_cli = staticmethod(evaluate_replies)  # eval loss, answer metrics, the generations file


def read_completions(output_dir: str | Path) -> dict[int, list[dict]]:
    """A run's completions file as ``{step: lines}``; a step written twice (a resumed run ran it again)
    keeps its last write, as :func:`qwenkit.engine.run.metrics.series` keeps a metric's last row."""
    out: dict[int, list[dict]] = {}
    for line in read_jsonl(Path(output_dir) / "metrics" / SAMPLE_FILE):
        if line["k"] == 0:  # a write of this step begins
            out[line["step"]] = []
        out[line["step"]].append(line)
    return out


def _gather(t: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``t`` (equal counts on every rank), in rank order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts)
