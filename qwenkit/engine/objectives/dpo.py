"""The preference objective (``train.objective: dpo``): DPO and its kin at the memory of SFT.

One micro-batch holds ``P`` whole pairs as ``2P`` rows, chosen then rejected
(:class:`qwenkit.data.preference.PairCollator`). Per micro-batch:

1. the policy's per-sequence reply log-probs of all ``2P`` rows in **one forward** through the
   chunked head (the model's ``sequence_logps`` method): no ``[2P, S, V]`` logits, in
   forward or backward;
2. the reference's, without grad, from :class:`Reference`: with LoRA the same model with its
   adapters disabled (no second copy); with full fine-tuning a frozen copy sharded by FSDP2 like
   the policy; or, with ``dpo.precompute_ref``, a table written by one pass over the data before
   the first step (keyed by the data's index fingerprint and the model files, reused across
   restarts); none for SimPO;
3. the loss share of :mod:`qwenkit.model.losses.preference`, normalised by the **global** pairs
   (and chosen tokens for ``dpo.sft_weight``) of the step: world size and accumulation do not
   change the step (the trainer backpropagates ``share * world_size``, as for SFT).

Under ``parallel.sp_size > 1`` every rank of a group holds the group's micro-batch and runs its slice of every
chosen and rejected row, padded or packed (the policy, the policy with its adapters off, the frozen copy alike):
each sequence's log-prob sum is that of its per-token log-probs gathered once over the group
(:meth:`~qwenkit.model.families.chunked.ChunkLossMixin.sequence_logps`), so every rank of the group takes the
whole loss, its gradient through its own slice (:meth:`qwenkit.distributed.sequence.SequenceParallel.share`);
pairs, chosen tokens and metrics count once per group, and the precompute pass and evaluation deal pairs by
group (:func:`for_each_pair_batch`).

Metrics carry TRL's names (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``), plus ``logps/accuracies`` (the
policy's own preference, reference aside), means over the step's global pairs; evaluation on held-out pairs logs the same with the ``eval_`` prefix and ``eval_loss``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method

from qwenkit import data as qdata
from qwenkit.config import DTYPES
from qwenkit.data import cache
from qwenkit.data.preference import PairCollator, PairDataset
from qwenkit.engine.objective import Objective
from qwenkit.engine.run.build import reference_model
from qwenkit.model import lora, paths
from qwenkit.model.families import registry as families
from qwenkit.model.losses.logps import full_sequence_logps
from qwenkit.model.losses.preference import pair_losses, preference_loss_share

log = logging.getLogger(__name__)

PAIR_KEYS = ("num_pairs", "num_chosen_items", "pair_index")  # what the objective pops from a micro-batch
# TRL's names; logps/accuracies (not TRL's): the share of pairs whose chosen reply the policy itself finds
# likelier, the reference aside (at step 0 the starting model's own preference accuracy)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected", "logps/accuracies")  # fmt: skip


def policy_logps(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums [2P], counts [2P])`` of the reply log-probs of a pair micro-batch (chosen rows first)."""
    return model.sequence_logps(**batch)


def enable(model: nn.Module) -> nn.Module:
    """Let FSDP2's root hooks gather parameters around ``model.sequence_logps`` too."""
    register_fsdp_forward_method(model, "sequence_logps")
    return model


class Reference:
    """The reference's ``(chosen, rejected)`` log-probs of a micro-batch; see the module docstring.

    ``kind``: ``adapters`` (the policy, adapters disabled) | ``copy`` (a frozen model) |
    ``precomputed`` (tables by pair index) | ``policy`` (the policy itself: only before its
    first step, for the precompute pass) | ``none`` (SimPO).
    """

    def __init__(self, kind: str, model: nn.Module | None = None, tables: dict | None = None):
        self.kind, self.model, self.tables = kind, model, tables or {}

    def __call__(self, policy: nn.Module, batch: dict, pairs: torch.Tensor, split: str = "train"):
        if self.kind == "none":
            return None, None
        if self.kind == "precomputed":
            table = self.tables[split].to(pairs.device)  # [P_all, 2]
            return table[pairs, 0], table[pairs, 1]
        with torch.no_grad():
            if self.kind == "adapters":
                with lora.adapters_disabled(policy):
                    sums, _ = policy_logps(policy, batch)
            else:
                sums, _ = policy_logps(self.model if self.kind == "copy" else policy, batch)
        n = sums.shape[0] // 2
        return sums[:n], sums[n:]


def build_reference(cfg, rt, model: nn.Module, bundle, main_rank: bool, sp=None) -> Reference:
    """The run's reference. Called before a checkpoint is loaded: the policy still holds the starting weights."""
    if cfg.dpo.loss == "simpo":
        return Reference("none")
    if cfg.dpo.precompute_ref:
        live = Reference("adapters" if lora.has_adapters(model) else "policy")
        tables = {"train": precomputed(cfg, rt, model, live, bundle.dataset, bundle.collator, main_rank, sp)}
        if bundle.eval_dataset is not None:
            tables["eval"] = precomputed(cfg, rt, model, live, bundle.eval_dataset, bundle.collator, main_rank, sp)
        return Reference("precomputed", tables=tables)
    if lora.has_adapters(model):
        return Reference("adapters")
    if main_rank:
        log.info("dpo reference: a frozen copy of %s, sharded like the policy", cfg.model.path)
    return Reference("copy", enable(reference_model(cfg, rt, model)))


# ---------------------------------------------------------------------------------------------
# dpo.precompute_ref


def reference_path(cfg, dataset) -> tuple[Path, str]:
    """``(file, key)``: the table of ``dataset``'s reference log-probs next to its index, and what it is keyed by."""
    samples = dataset.samples
    index_key = cache.fingerprint(samples.sources, samples.processor, samples.data)[0]
    model_dir = Path(paths.resolve_path(cfg.model))
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir() if p.is_file())
    inputs = {"index": index_key, "model": str(model_dir.resolve()), "files": files, "dtype": cfg.model.dtype,
              "lora": cfg.lora.r > 0, "pairs": len(dataset)}  # fmt: skip
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]
    return Path(cache.cache_dir(samples.data)) / f"ref-logps-{key}.pt", key


def precomputed(cfg, rt, model, live: Reference, dataset, collator, main_rank: bool, sp=None) -> torch.Tensor:
    """``[P, 2]`` reference log-probs of every pair of ``dataset``: read, or computed once and written."""
    path, key = reference_path(cfg, dataset)
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["key"] == key and saved["logps"].shape == (len(dataset), 2):
            if main_rank:
                log.info("dpo.precompute_ref: reference log-probs of %d pairs read from %s", len(dataset), path)
            return saved["logps"]
    table = torch.zeros(len(dataset), 2, dtype=torch.float32, device=rt.device)

    def fill(policy, batch, pairs, valid):
        c, r = live(policy, batch, pairs)
        table[pairs[valid]] = torch.stack([c, r], 1)[valid].float()

    for_each_pair_batch(model, dataset, collator, cfg.train.micro_batch_size, rt, fill, sp)
    # The root keeps its parameters gathered after a forward (reshard_after_forward=False, for the
    # backward); without a backward they would stay so, and the optimizer built next would take the
    # unsharded tensors for the sharded parameters (wrong grad norm, wrong updates)
    model.reshard()
    dist.all_reduce(table)  # each pair was filled in by exactly one rank
    table = table.cpu()
    if main_rank:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"key": key, "logps": table}, tmp)
        tmp.replace(path)
        log.info("dpo.precompute_ref: reference log-probs of %d pairs written to %s", len(dataset), path)
    dist.barrier()
    return table


def for_each_pair_batch(model, dataset, collator, batch_size: int, rt, fn, sp=None) -> None:
    """``fn(model, batch, pairs, valid)`` over this rank's pairs ``rank, rank + W, ...`` in micro-batches.

    Every rank runs the same number of forwards (FSDP's collectives need it): a rank out of
    pairs runs pair 0 with ``valid`` False. Under sequence parallelism (``sp``, this rank's group) the rank
    and ``W`` are the group's among the data-parallel groups: every rank of a group runs the same pairs, its
    slice of them, and only the group's first counts them (``valid`` False on the others). Runs in ``eval()`` mode.
    """
    rank, size, counts = (sp.dp_rank, sp.dp_size, sp.rank == 0) if sp is not None else (rt.rank, rt.world_size, True)
    mine = list(range(rank, len(dataset), size))
    batches = math.ceil(math.ceil(len(dataset) / size) / batch_size)
    was_training = model.training
    model.eval()
    try:
        for b in range(batches):
            picked = mine[b * batch_size : (b + 1) * batch_size]
            valid = torch.tensor([counts] * len(picked) or [False], device=rt.device)
            picked = picked or [0]
            batch = collator([dataset[p] for p in picked])
            pairs = torch.tensor(picked, device=rt.device)
            batch = {k: v.to(rt.device) for k, v in batch.items() if k not in (*PAIR_KEYS, "num_items", "num_samples",
                                                                                  "num_bad")}  # fmt: skip
            fn(model, batch, pairs, valid)
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------------------------------
# The objective in the trainer's step


class PreferenceObjective(Objective):
    """The trainer's hooks for ``train.objective: dpo`` (see :mod:`qwenkit.engine.objective`)."""

    def __init__(self, cfg, reference: Reference, device: torch.device, evaluator: PreferenceEvaluator | None = None,
                 sp=None):  # fmt: skip
        self.dpo, self.reference, self.device, self.evaluator = cfg.dpo, reference, device, evaluator
        self.sp = sp if sp is not None and sp.size > 1 else None  # a sequence-parallel group: sliced forwards
        self.queue: list[torch.Tensor] = []  # pair indices of the step's micro-batches, in order
        self.norms = self.sums = None

    @classmethod
    def build(cls, cfg, rt, model: nn.Module, bundle, sp=None, out_dir=None) -> PreferenceObjective:
        """The model is sharded and holds its starting weights: the reference is built from them."""
        enable(model)
        reference = build_reference(cfg, rt, model, bundle, rt.rank == 0, sp)
        evaluator = None
        if bundle.eval_dataset is not None:
            evaluator = PreferenceEvaluator(cfg, bundle.eval_dataset, bundle.collator, reference, rt, sp)
        return cls(cfg, reference, rt.device, evaluator, sp)

    def begin(self, micro: list[dict], counts: torch.Tensor) -> None:
        """Pop the pair keys of the step's micro-batches; the global pair and chosen-token counts."""
        self.queue = [b.pop("pair_index") for b in micro]
        counts = torch.stack([torch.stack([b.pop("num_pairs"), b.pop("num_chosen_items")]) for b in micro]).sum(0)
        counts = counts.to(self.device)
        dist.all_reduce(counts)
        self.norms = counts // (self.sp.size if self.sp is not None else 1)  # [global pairs, chosen tokens]: once per SP group
        self.sums = torch.zeros(len(METRICS), dtype=torch.float64, device=self.device)

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """This micro-batch's share of the step's loss; adds to the step's metric sums."""
        pairs = self.queue.pop(0).to(self.device)
        sums, counts = policy_logps(model, batch)
        n = sums.shape[0] // 2
        ref_c, ref_r = self.reference(model, batch, pairs)
        terms = pair_losses(sums[:n], sums[n:], ref_c, ref_r, counts[:n], counts[n:], self.dpo.loss, self.dpo.beta,
                            self.dpo.gamma, self.dpo.label_smoothing)  # fmt: skip
        if self.sp is None or self.sp.rank == 0:  # the group's ranks hold the same pairs: counted once
            self.sums += _metric_sums(terms, sums[:n].detach(), sums[n:].detach())
        share = preference_loss_share(terms, sums[:n], self.norms[0], self.norms[1], self.dpo.sft_weight)
        return self.sp.share(share) if self.sp is not None else share  # the whole loss on each rank of the group

    def metrics(self) -> dict[str, float]:
        """The step's metrics (TRL's names): one all-reduce, means over the global pairs."""
        dist.all_reduce(self.sums)
        return dict(zip(METRICS, (self.sums / self.norms[0].clamp(min=1)).tolist()))

    @staticmethod
    def evaluate_cli(request, model, processor, cfg, name: str, rank: int, world_size: int, device) -> int:
        """``qwenkit eval`` of a dpo run: held-out pairs, the metrics the trainer logs (:func:`evaluate_pairs`);
        ``--samples``: the first that many pairs. Nothing is generated, so ``--metric`` is refused; rank 0
        scores every pair."""
        if request.metric is not None:
            raise ValueError(f"--metric {' '.join(request.metric)}: a dpo run is evaluated on its held-out pairs (the "
                             "trainer's preference metrics), nothing is generated to score; leave --metric out")  # fmt: skip
        if rank != 0:
            return 0
        if request.data is not None:
            dataset = PairDataset(qdata.read_checked(cfg.data, processor, request.data, reads="pairs")[0])
        else:
            dataset = qdata.build(cfg, processor).eval_dataset
        if dataset is None or len(dataset) == 0:
            where = f"--data {request.data!r}" if request.data else "the run"
            raise ValueError(f"{where}: no held-out pairs to evaluate; pass --data PATH")
        if request.samples is not None:
            dataset = PairDataset(dataset.samples, dataset.pairs[: request.samples])
        reference = None
        if cfg.dpo.loss != "simpo":  # the run's starting weights (model.path; a LoRA run's base)
            start = paths.resolve_path(cfg.model)
            reference = families.of_model(model).load("hf_class").from_pretrained(  # the evaluated model's family
                start, dtype=DTYPES[cfg.model.dtype], local_files_only=True
            ).to(device).eval()  # fmt: skip
        values = evaluate_pairs(cfg, model.eval(), reference, dataset, PairCollator(processor), device)
        for metric, value in values.items():
            print(f"{metric} {value:.4f}")
        print(f"pairs: {len(dataset)}")
        return 0


def _metric_sums(terms, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    margins = terms.chosen_rewards - terms.rejected_rewards
    return torch.stack([terms.chosen_rewards.sum(), terms.rejected_rewards.sum(), margins.sum(),
                        (margins > 0).sum(), chosen.sum(), rejected.sum(), (chosen > rejected).sum()]).double()  # fmt: skip


class PreferenceEvaluator:
    """Held-out pairs: ``eval_loss`` (the preference loss, mean over pairs) and ``eval_`` + TRL's metrics.

    Due at step 0 (fresh runs), every ``train.eval_every`` steps and at ``train.steps`` (as SFT's).
    """

    def __init__(self, cfg, dataset, collator, reference: Reference, rt, sp=None):
        self.cfg, self.dataset, self.collator, self.reference, self.rt = cfg, dataset, collator, reference, rt
        self.sp = sp

    def due(self, step: int) -> bool:
        t = self.cfg.train
        return step == 0 or step == t.steps or (t.eval_every > 0 and step % t.eval_every == 0)

    def run(self, step: int, model: nn.Module) -> dict[str, float]:
        total = torch.zeros(len(METRICS) + 2, dtype=torch.float64, device=self.rt.device)  # + loss sum, pairs

        def add(policy, batch, pairs, valid):
            with torch.no_grad():
                sums, counts = policy_logps(policy, batch)
                ref_c, ref_r = self.reference(policy, batch, pairs, split="eval")
            total.add_(_eval_sums(self.cfg.dpo, sums, counts, ref_c, ref_r, valid))

        for_each_pair_batch(model, self.dataset, self.collator, self.cfg.train.micro_batch_size, self.rt, add, self.sp)
        dist.all_reduce(total)
        return eval_values(total)


def _eval_sums(dpo, sums, counts, ref_c, ref_r, valid) -> torch.Tensor:
    """``[metric sums..., loss sum, pairs]`` of one micro-batch of held-out pairs (the ``valid`` ones)."""
    n = sums.shape[0] // 2
    terms = pair_losses(sums[:n], sums[n:], ref_c, ref_r, counts[:n], counts[n:], dpo.loss, dpo.beta, dpo.gamma,
                        dpo.label_smoothing)  # fmt: skip
    for name in ("losses", "chosen_rewards", "rejected_rewards"):
        setattr(terms, name, getattr(terms, name)[valid])
    extra = torch.stack([terms.losses.sum().double(), valid.sum().double()])
    return torch.cat([_metric_sums(terms, sums[:n][valid], sums[n:][valid]), extra])


def eval_values(total: torch.Tensor) -> dict[str, float]:
    """``eval_loss`` and ``eval_`` + :data:`METRICS`, means over the pairs, from the summed :func:`_eval_sums`."""
    pairs = total[-1].clamp(min=1)
    values = {"eval_loss": (total[-2] / pairs).item()}
    values.update({f"eval_{name}": v for name, v in zip(METRICS, (total[: len(METRICS)] / pairs).tolist())})
    return values


def evaluate_pairs(cfg, policy: nn.Module, reference: nn.Module | None, dataset, collator, device) -> dict[str, float]:
    """``qwenkit eval`` of a dpo run (one process, HF's own classes): the metrics the trainer logs.

    ``reference``: the run's starting model (``model.path``), None for SimPO. Log-probs come from
    HF's full logits (:func:`qwenkit.model.losses.logps.full_sequence_logps`): no process group here, and
    evaluation keeps no graph.
    """
    def logps(model, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return full_sequence_logps(model(**inputs, use_cache=False).logits.float(), batch["labels"])

    total = torch.zeros(len(METRICS) + 2, dtype=torch.float64, device=device)
    size = cfg.train.micro_batch_size
    for start in range(0, len(dataset), size):
        batch = collator([dataset[p] for p in range(start, min(start + size, len(dataset)))])
        batch = {k: v.to(device) for k, v in batch.items() if k not in (*PAIR_KEYS, "num_items", "num_samples",
                                                                          "num_bad")}  # fmt: skip
        with torch.no_grad():
            sums, counts = logps(policy, batch)
            ref = logps(reference, batch)[0] if reference is not None else None
        n = sums.shape[0] // 2
        valid = torch.ones(n, dtype=torch.bool, device=device)
        total += _eval_sums(cfg.dpo, sums, counts, *((ref[:n], ref[n:]) if ref is not None else (None, None)), valid)
    return eval_values(total)


__all__ = ["METRICS", "PreferenceEvaluator", "evaluate_pairs", "PreferenceObjective", "Reference"]
