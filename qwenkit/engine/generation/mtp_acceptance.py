"""MTP acceptance: how often Qwen3.5's multi-token-prediction layer would have its draft accepted.

``qwenkit eval --metric mtp_acceptance`` and, in a ``model.mtp.train`` run, the logged
``eval_mtp_acceptance``. For each held-out reply, the fraction of its positions where the MTP
layer's top-1 draft equals the token the model itself produces greedily there: at a position t
whose token t+2 lies in the reply, the draft is the first MTP depth's top-1 on (``h_t``, token
t+1), the model's token is the main head's top-1 at t+1, both given the reply through t+1 (one
forward, no generation: :func:`qwenkit.model.families.mtp.draft_agreement`). That is what
speculative decoding with one draft token and greedy verification accepts along that reply
(verl and slime log it as ``spec_accept_rate``); the logged value is the mean over the replies
with at least one such position, each rank its share of the eval set's rows as the eval loss's.

The layer: a ``model.mtp.train`` model's own; for ``qwenkit eval`` the checkpoint's ``mtp.*``
put on HF's class (:func:`attach`): a checkpoint's trained tensors, else the base model's, an
export's own file (``model-mtp.safetensors``, :func:`qwenkit.engine.checkpoints.export.keep_mtp`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

from qwenkit import config as qconfig
from qwenkit.data.template import IGNORE_INDEX
from qwenkit.engine.checkpoints.export import trained_mtp
from qwenkit.model.families import mtp
from qwenkit.model.families.chunked import ChunkLossMixin

METRIC = "mtp_acceptance"  # qwenkit eval --metric
LOGGED = "eval_mtp_acceptance"  # the trainer's eval metric


def metric_problems(names) -> list[str]:
    """``--metric``: the answer scorers' checks, or :data:`METRIC` alone (a forward, not a scored reply)."""
    if METRIC not in names:
        return qconfig.scorer_problems(list(names), "--metric")
    if len(names) > 1:
        return [f"--metric {METRIC} is measured alone (a forward over the held-out replies, no generation); "
                f"score {', '.join(n for n in names if n != METRIC)} in another qwenkit eval"]  # fmt: skip
    return []


def problem(names, source) -> str | None:
    """Why ``--metric`` cannot be measured on ``source``'s model (an ``EvalSource``; before any rank starts), or None."""
    if METRIC in (names or ()) and not (family := source.spec.family).mtp_layers:
        return (f"--metric {METRIC}: {family.name} has no multi-token-prediction layer (Qwen3.5's families "
                "have one); leave the metric out")  # fmt: skip
    return None


@torch.no_grad()
def agreement(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample ``(accepted, drafted)`` positions of ``batch`` (on the model's device)."""
    if isinstance(model, ChunkLossMixin):  # the trainer's model: the backbone as its chunk-loss forward runs it
        return model.mtp_agreement(**batch)
    ids, labels = batch["input_ids"], batch["labels"]
    hidden = model.model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).last_hidden_state
    return mtp.draft_agreement(model, hidden, ids, labels)


@torch.no_grad()
def acceptance(model: nn.Module, dataset, collator, batch_size: int, rank: int, world_size: int, device,
               indices: list[int] | None = None) -> tuple[float, int, int]:  # fmt: skip
    """``(mean acceptance over the replies, replies, drafted positions)`` of ``dataset``'s rows ``indices``
    (all by default), rank ``r`` taking every W-th from ``r``; collective, every rank the same forwards."""
    indices = list(range(len(dataset))) if indices is None else indices
    mine = indices[rank::world_size]
    batches = math.ceil(math.ceil(len(indices) / world_size) / batch_size)
    was_training = model.training
    model.eval()
    total = torch.zeros(3, dtype=torch.float64, device=device)  # [sum of the replies' fractions, replies, positions]
    try:
        for b in range(batches):
            rows = [dataset[i] for i in mine[b * batch_size : (b + 1) * batch_size]]
            if not rows:  # this rank is out of rows: the same forwards, nothing counted
                rows = [dataset[indices[0]]]
                rows[0]["labels"] = torch.full_like(rows[0]["labels"], IGNORE_INDEX)
            batch = collator(rows)
            for key in ("num_items", "num_samples", "num_bad"):
                batch.pop(key, None)
            accepted, drafted = agreement(model, {k: v.to(device) for k, v in batch.items()})
            some = drafted > 0
            total += torch.stack([(accepted[some] / drafted[some]).sum().double(), some.sum().double(), drafted.sum().double()])
    finally:
        model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(total)
    fractions, replies, positions = total.tolist()
    if replies == 0:
        raise ValueError(f"{METRIC}: no held-out reply has two tokens (nothing for the MTP layer to draft)")
    return fractions / replies, int(replies), int(positions)


class WithAcceptance:
    """A trainer's evaluator plus :data:`LOGGED` wherever it logs ``eval_loss`` (a ``model.mtp.train`` run)."""

    def __init__(self, evaluator, model: nn.Module):
        self.evaluator = evaluator
        if isinstance(model, FSDPModule):  # the root's hooks gather its parameters around the method too
            register_fsdp_forward_method(model, "mtp_agreement")

    def due(self, step: int) -> bool:
        return self.evaluator.due(step)

    def run(self, step: int, model: nn.Module) -> dict[str, float]:
        values = self.evaluator.run(step, model)
        if "eval_loss" in values:
            e = self.evaluator
            rank, world = (e.rank, e.world_size)
            values[LOGGED] = acceptance(model, e.dataset, e.collator, e.cfg.train.micro_batch_size, rank, world, e.device)[0]
        return values


def attach(model: nn.Module, source) -> int:
    """Put the MTP layer on ``model`` (HF's class, evaluated) from ``source`` (an
    :class:`~qwenkit.engine.generation.eval_command.EvalSource`); returns its tensors' count. A LoRA run's
    checkpoint arrives with it (:func:`qwenkit.engine.checkpoints.export.load_hf`: its adapters merged)."""
    if getattr(model, "mtp", None) is not None:
        return len(model.mtp.state_dict())
    tensors = trained_mtp(source.path) if source.kind == "checkpoint" else {}
    depths = {k.split(".")[2] for k in tensors if k.startswith(mtp.PREFIX + "layers.")}
    mtp.attach(model, len(depths) or source.spec.family.mtp_layers, 0.0)
    if not tensors:
        return mtp.load_from_checkpoint(model, source.spec.path)
    model.mtp.load_state_dict({k[len(mtp.PREFIX) :]: v for k, v in tensors.items()})
    return len(tensors)


def evaluate_cli(source, model: nn.Module, dataset, collator, batch_size: int, rank: int, world_size: int, device,
                 samples: int | None = None) -> int:  # fmt: skip
    """``qwenkit eval --metric mtp_acceptance``: prints the acceptance of ``dataset``'s first ``samples`` rows (all: None)."""
    attach(model, source)
    model.mtp.to(device)
    indices = list(range(len(dataset) if samples is None else min(samples, len(dataset))))
    value, replies, positions = acceptance(model, dataset, collator, batch_size, rank, world_size, device, indices)
    if rank == 0:
        print(f"{METRIC} {value:.4f} (the mean over {replies} replies; {positions} drafted positions)")
    return 0
