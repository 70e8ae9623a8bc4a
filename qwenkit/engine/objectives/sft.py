"""Supervised fine-tuning (``train.objective: sft``): the replies' cross-entropy, one objective among peers.

The loss is the model's own (:class:`qwenkit.model.families.chunked.ChunkLossMixin`: chunked or HF's
forward, ``loss.loss_type``), normalised by the step's **global** label tokens and samples that
the trainer counted (``counts``, all ranks and accumulation steps): a rank's loss is its share of
the global mean. Held-out rows give ``eval_loss`` and the answer metrics
(:class:`qwenkit.engine.generation.evaluate.Evaluator`), and with ``model.mtp.train`` the MTP layer's
``eval_mtp_acceptance`` beside the eval loss (:mod:`qwenkit.engine.generation.mtp_acceptance`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from qwenkit.engine.generation.eval_command import evaluate_generations
from qwenkit.engine.generation.evaluate import Evaluator
from qwenkit.engine.generation.mtp_acceptance import WithAcceptance
from qwenkit.engine.objective import Objective


class Sft(Objective):
    """The trainer's hooks for ``train.objective: sft`` (see :mod:`qwenkit.engine.objective`)."""

    def __init__(self, evaluator: Evaluator | WithAcceptance | None = None):
        self.evaluator = evaluator
        self.num_items = self.num_samples = None  # the step's global label tokens and samples
        self.mtp_loss = None  # model.mtp.train: this rank's share of the step's MTP loss (its micro-batches')

    @classmethod
    def build(cls, cfg, rt, model: nn.Module, bundle, sp=None, out_dir=None) -> Sft:
        if bundle.eval_dataset is None:
            return cls()
        evaluator = Evaluator(cfg, bundle.eval_dataset, bundle.collator, rt.rank, rt.world_size, rt.device, out_dir, sp=sp)
        return cls(WithAcceptance(evaluator, model) if getattr(model, "mtp", None) is not None else evaluator)

    def begin(self, micro: list[dict], counts: torch.Tensor) -> None:
        self.num_items, self.num_samples = counts[0], counts[1]
        self.mtp_loss = None

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        # use_cache=False: HF's config defaults to a KV cache, which training never needs and
        # which a recomputed decoder layer would extend a second time in its backward
        loss = model(**batch, use_cache=False, num_items_in_batch=self.num_items, num_samples=self.num_samples).loss
        if getattr(model, "mtp", None) is not None:  # normalised as the main loss: the micro-batches' and ranks' sum
            self.mtp_loss = model.last_mtp_loss + (0 if self.mtp_loss is None else self.mtp_loss)
        return loss

    def metrics(self) -> dict[str, float]:
        """``mtp_loss`` (model.mtp.train): the MTP layer's loss of the step, before its weight (one all-reduce)."""
        if self.mtp_loss is None:
            return {}
        total = self.mtp_loss.detach().float().clone()
        dist.all_reduce(total)
        return {"mtp_loss": total.item()}

    evaluate_cli = staticmethod(evaluate_generations)  # eval loss, answer metrics, the generations file
