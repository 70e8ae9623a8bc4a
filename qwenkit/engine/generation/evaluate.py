"""Held-out evaluation during training: eval loss and generation accuracy, each rank its share.

Schedule (:meth:`Evaluator.due`): before the first step (step 0, fresh runs only), every
``train.eval_every`` steps, and at ``train.steps``. It depends on the step alone, so a resumed
run evaluates at exactly the steps an uninterrupted one does.

**Eval loss** is the token mean over the *whole* eval set, whatever the world size: rank ``r``
takes rows ``r, r + W, r + 2W, ...`` in micro-batches of ``train.micro_batch_size``; the eval
loss function (:func:`token_loss_sum`, as torchtitan's validator takes its ``loss_fn``) gives
each batch's *sum* of token losses whatever the training loss type, and one all-reduce of
``[sum, tokens]`` gives the mean. All ranks
run the same number of forwards (FSDP's collectives need that): a rank out of rows runs a row
with every label ignored, which adds 0 to both. It runs in ``eval()`` mode under
``torch.no_grad()``: no activations kept, no gradients, parameters untouched.

**Accuracy** scores the replies to the first ``train.eval_samples`` eval rows by
``train.eval_metrics`` (:mod:`qwenkit.engine.generation.answers`; ``exact`` by default). Every rank
generates (and scores) its share of the rows in batches of ``train.eval_batch_size``, from a
full copy of the weights or from the sharded model in lockstep (``train.eval_generation``, the
choice logged; see :mod:`qwenkit.engine.generation.generate`); rank 0 gathers the rows in row order,
writes them to ``<output_dir>/eval/step-NNNNNN.jsonl`` and broadcasts the means:
``eval_accuracy`` is the first metric's, and with several metrics each is also logged as
``eval_accuracy/<name>``. ``eval_generation_time`` is the rank's seconds from its first prompt
to the means (generation, scores, the rows' gather; the copy's gather before it is logged apart).
With ``train.eval_engine: vllm`` the replies come from this rank's colocated vLLM engine instead (the
one GRPO's vLLM rollouts use), the weights pushed to it first
(:mod:`qwenkit.engine.generation.vllm_engine`); ``qwenkit eval --engine vllm`` does the same.

``qwenkit eval`` (:mod:`qwenkit.engine.generation.eval_command`) runs these same functions on a saved run.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from qwenkit.data.template import IGNORE_INDEX
from qwenkit.engine.generation import answers, placement, vllm_engine
from qwenkit.engine.generation import generate as qgen
from qwenkit.model.families import registry as families
from qwenkit.model.families.chunked import ChunkLossMixin
from qwenkit.model.losses.cross_entropy import TOKEN_SUM, full_cross_entropy

log = logging.getLogger(__name__)


def generations_path(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "eval" / f"step-{step:06d}.jsonl"


def token_loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
    """The eval loss function: the sum of ``batch``'s label-token cross-entropies.

    qwenkit's model computes it itself (chunked or not) when asked for ``loss_type=token_sum``;
    HF's own class (``qwenkit eval`` on an export) returns logits, reduced here by the same
    reference loss the model uses.
    """
    if isinstance(model, ChunkLossMixin):  # any family's subclass; HF's own class returns logits
        return model(**batch, loss_type=TOKEN_SUM).loss
    labels = batch["labels"]
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits  # [B, S, V]
    return full_cross_entropy(logits, labels, TOKEN_SUM)


@torch.no_grad()
def eval_loss(
    model: nn.Module, dataset, collator, batch_size: int, rank: int, world_size: int, device,
    loss_fn=token_loss_sum, sp_rank: int = 0,
) -> float:  # fmt: skip
    """Global token-mean loss of ``model`` over all of ``dataset`` (collective: every rank calls it).

    ``loss_fn(model, batch)``: the batch's sum of token losses (:func:`token_loss_sum`).
    Sequence parallelism: ``rank`` / ``world_size`` are the SP group's place among the groups
    (every rank of a group runs the same rows, each returning its slice's sum) and only the
    group's ``sp_rank`` 0 counts the label tokens.
    """
    mine = list(range(rank, len(dataset), world_size))
    per_rank = math.ceil(len(dataset) / world_size)
    batches = math.ceil(per_rank / batch_size)
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, label tokens]
    try:
        for b in range(batches):
            rows = [dataset[i] for i in mine[b * batch_size : (b + 1) * batch_size]]
            if not rows:  # this rank is out of rows: same collectives, nothing counted
                filler = dataset[0]
                filler["labels"] = torch.full_like(filler["labels"], IGNORE_INDEX)
                rows = [filler]
            batch = collator(rows)
            items = batch.pop("num_items")
            batch.pop("num_samples")
            batch = {k: v.to(device) for k, v in batch.items()}
            loss_sum = loss_fn(model, batch)
            items = items if sp_rank == 0 else torch.zeros_like(items)
            total += torch.stack([loss_sum.detach().double(), items.to(device).double()])
    finally:
        model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(total)
    loss_sum, tokens = total.tolist()
    if tokens == 0:
        raise ValueError("the eval set has no label tokens (no assistant reply survived data.max_length)")
    return loss_sum / tokens


class Evaluator:
    """One rank's evaluation of a training run (see the module docstring)."""

    def __init__(self, cfg, dataset, collator, rank: int, world_size: int, device, output_dir: str | Path, sp=None):
        self.cfg, self.dataset, self.collator = cfg, dataset, collator
        self.rank, self.world_size, self.device = rank, world_size, device
        self.sp = sp  # qwenkit.distributed.sequence.SequenceParallel, or None
        self.output_dir = Path(output_dir)
        self.samples = list(range(min(cfg.train.eval_samples, len(dataset))))
        # GRPO's eval rows may all be prompts alone (their reference a column): no reply, no eval loss
        self.replies = bool(dataset.index.label_tokens.sum())

    def due(self, step: int) -> bool:
        t = self.cfg.train
        return step == 0 or step == t.steps or _every(step, t.eval_every) or self.generates(step)

    def generates(self, step: int) -> bool:
        t = self.cfg.train
        return bool(self.samples) and (step in (0, t.steps) or _every(step, t.eval_accuracy_every))

    def run(self, step: int, model: nn.Module) -> dict[str, float]:
        """``eval_loss`` (and ``eval_accuracy`` at step 0, the last step and every
        ``train.eval_accuracy_every``); collective. No ``eval_loss`` where no row has a reply."""
        t = self.cfg.train
        if self.sp is not None and self.sp.size > 1:
            where = (self.sp.dp_rank, self.sp.dp_size, self.sp.rank)
        else:
            where = (self.rank, self.world_size, 0)
        values = {}
        if self.replies:
            values["eval_loss"] = eval_loss(model, self.dataset, self.collator, t.micro_batch_size,
                                            where[0], where[1], self.device, sp_rank=where[2])  # fmt: skip
        if self.generates(step):
            values.update(self.accuracy(step, model))
        return values

    def accuracy(self, step: int, model: nn.Module) -> dict[str, float]:
        t0 = time.perf_counter()
        t = self.cfg.train
        sampling = qgen.Sampling.of(t)
        if t.eval_engine == "vllm":
            engine = vllm_engine.shared(vllm_engine.spec_of(self.cfg, self.dataset.processor, model.name_or_path))
            engine.push(model)
            t1 = time.perf_counter()
            values = generate_and_score(model, self.dataset, self.samples, sampling, t.eval_metrics, self.rank,
                                        self.world_size, generations_path(self.output_dir, step), engine=engine)  # fmt: skip
            seconds = time.perf_counter() - t1
            if self.rank == 0:
                log.info("eval at step %d: %d rows generated in %.2f s by vLLM (weights pushed in %.2f s) on %d rank(s)",
                         step, len(self.samples), seconds, t1 - t0, self.world_size)  # fmt: skip
            return {**accuracy_values(values), "eval_generation_time": seconds}
        longest = max(int(self.dataset.lengths[i]) for i in self.samples)
        mode, why = placement.choose_generation(t.eval_generation, model, sampling, longest, self.device)
        if mode == "gather":  # HF's own class on the full weights: what from_pretrained on an export of them gives
            source = placement.unsharded_copy(model, families.of_model(model).load("hf_class"), self.device)
        else:
            source = model
        t1 = time.perf_counter()
        values = generate_and_score(source, self.dataset, self.samples, sampling, t.eval_metrics, self.rank,
                                    self.world_size, generations_path(self.output_dir, step), lockstep=mode == "lockstep")  # fmt: skip
        del source
        seconds = time.perf_counter() - t1
        if self.rank == 0:
            log.info("eval at step %d: %d rows generated in %.2f s (%s; then generation, scores) on %d rank(s), "
                     "batches of %d; %s", step, len(self.samples), seconds,
                     f"copy gathered in {t1 - t0:.2f} s" if mode == "gather" else "lockstep", self.world_size,
                     t.eval_batch_size, why)  # fmt: skip
        return {**accuracy_values(values), "eval_generation_time": seconds}


def generate_and_score(
    model: nn.Module, dataset, indices: list[int], sampling: qgen.Sampling, metric_names: list[str],
    rank: int, world_size: int, out: Path, lockstep: bool = False, engine=None,
) -> dict[str, float]:  # fmt: skip
    """Each rank generates and scores its share of ``indices``; rank 0 writes every row to ``out``
    in row order; returns each metric's mean, the same on every rank (collective).
    ``lockstep``: ``model`` is the sharded training model, stepped by every rank together.
    ``engine``: a :class:`~qwenkit.engine.generation.vllm_engine.VllmEngine` holding ``model``'s weights generates."""
    metrics = answers.resolve(metric_names)
    mine = qgen.share(indices, rank, world_size)
    if engine is not None:
        rows = vllm_engine.generate_rows(engine, dataset, mine, sampling, rank)
    else:
        calls = placement.lockstep_calls(len(indices), world_size, sampling.batch_size) if lockstep else None
        rows = qgen.generate_rows(model, dataset, mine, sampling, rank, lockstep_calls=calls)
    for r in rows:
        r.scores = answers.score(metrics, r.generated, r.reference, f"eval row {r.index}")
    rows = qgen.gather_rows(rows, rank, world_size)
    means = torch.zeros(len(metrics), dtype=torch.float64, device=next(model.parameters()).device)
    if rank == 0:
        qgen.write_jsonl(rows, out)
        means += torch.tensor([qgen.mean_scores(rows).get(name, 0.0) for name in metrics], dtype=torch.float64).to(means.device)
    if world_size > 1:
        dist.broadcast(means, src=0)  # every rank logs the same values
    return dict(zip(metrics, means.tolist()))


def accuracy_values(means: dict[str, float]) -> dict[str, float]:
    """The logged metrics: ``eval_accuracy`` (the first metric) and, with several, ``eval_accuracy/<name>``."""
    values = {"eval_accuracy": next(iter(means.values()))}
    if len(means) > 1:
        values.update({f"eval_accuracy/{name}": v for name, v in means.items()})
    return values


def _every(step: int, n: int) -> bool:
    return n > 0 and step % n == 0
