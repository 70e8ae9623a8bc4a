"""Held-out evaluation during training: eval loss on every rank, generation accuracy on rank 0.

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

**Accuracy** is the exact match of greedy replies on the first ``train.eval_samples`` eval rows,
generated on rank 0 from the gathered full weights (see :mod:`qwenkit.engine.generate`); each
evaluation writes them to ``<output_dir>/eval/step-NNNNNN.jsonl``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from qwenkit import config as qconfig
from qwenkit import data as qdata
from qwenkit.config import DTYPES
from qwenkit.data.template import IGNORE_INDEX
from qwenkit.engine import checkpoint as ckpt
from qwenkit.engine import generate as qgen
from qwenkit.engine.export import load_hf
from qwenkit.model import family as families
from qwenkit.model.chunked import ChunkLossMixin
from qwenkit.model.loss import TOKEN_SUM, full_cross_entropy
from qwenkit.model.paths import load_processor
from qwenkit.model.processor import Processor, pixel_bounds

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

    def due(self, step: int) -> bool:
        t = self.cfg.train
        return step == 0 or step == t.steps or _every(step, t.eval_every) or self.generates(step)

    def generates(self, step: int) -> bool:
        t = self.cfg.train
        return bool(self.samples) and (step in (0, t.steps) or _every(step, t.eval_accuracy_every))

    def run(self, step: int, model: nn.Module) -> dict[str, float]:
        """``eval_loss`` (and ``eval_accuracy`` at step 0, the last step and every
        ``train.eval_accuracy_every``); collective."""
        t = self.cfg.train
        if self.sp is not None and self.sp.size > 1:
            where = (self.sp.dp_rank, self.sp.dp_size, self.sp.rank)
        else:
            where = (self.rank, self.world_size, 0)
        values = {"eval_loss": eval_loss(model, self.dataset, self.collator, t.micro_batch_size,
                                         where[0], where[1], self.device, sp_rank=where[2])}  # fmt: skip
        if self.generates(step):
            values["eval_accuracy"] = self.accuracy(step, model)
        return values

    def accuracy(self, step: int, model: nn.Module) -> float:
        main_rank = self.rank == 0
        # HF's own class on the full weights: what from_pretrained on an export of them gives
        copy = qgen.unsharded_copy(model, families.of_model(model).load("hf_class"), self.device, main_rank)
        result = torch.zeros(1, dtype=torch.float64, device=self.device)
        if main_rank:
            rows = qgen.generate_rows(copy, self.dataset, self.samples, self.cfg.train.eval_max_new_tokens)
            qgen.write_jsonl(rows, generations_path(self.output_dir, step))
            result += qgen.accuracy(rows)
            del copy
        if dist.is_initialized():
            dist.broadcast(result, src=0)  # every rank logs the same value; the others waited here
        return result.item()


def _every(step: int, n: int) -> bool:
    return n > 0 and step % n == 0


# ---------------------------------------------------------------------------------------------
# qwenkit eval RUN_OR_CHECKPOINT


def load_for_eval(target: str | Path, config_path: str | Path | None = None):
    """``(model, processor, cfg, name)`` for a run's output_dir, a checkpoint, or an HF export directory.

    Checkpoints are gathered into HF's own class in this process (:func:`qwenkit.engine.export.load_hf`),
    with the config the run saved; an export (a directory with ``config.json``) is loaded with
    ``from_pretrained`` and the config given by ``config_path`` (else the defaults).
    """
    target = Path(target)
    if not target.exists():
        raise FileNotFoundError(f"{str(target)!r}: no such run, checkpoint or export")
    adapter = (target / "adapter_config.json").is_file()  # a LoRA export: peft on the base it names, merged
    if adapter or (target / "config.json").is_file():
        cfg = qconfig.load(config_path)
        # the export's processor resizes as its run did (qwenkit export writes the run's data
        # bounds there); a --config with other bounds would evaluate other image tokens
        processor = Processor.from_pretrained(target)
        lo, hi = pixel_bounds(processor.image_processor)
        if config_path is not None and (cfg.data.min_pixels, cfg.data.max_pixels) != (lo, hi):
            log.warning(
                "%s resizes images into %d..%d pixels (its preprocessor_config.json); %s's data.min_pixels/"
                "max_pixels (%d..%d) are not used", target, lo, hi, config_path, cfg.data.min_pixels, cfg.data.max_pixels,
            )  # fmt: skip
        cfg.data.min_pixels, cfg.data.max_pixels = lo, hi
        if adapter:
            from peft import PeftConfig, PeftModel  # the lora extra: LoRA exports only

            base = PeftConfig.from_pretrained(target).base_model_name_or_path
            model = families.resolve(cfg.model.name, base).load("hf_class").from_pretrained(
                base, dtype=DTYPES[cfg.model.dtype], local_files_only=True
            )
            model = PeftModel.from_pretrained(model, target).merge_and_unload()
        else:
            model = families.resolve(cfg.model.name, target).load("hf_class").from_pretrained(
                target, dtype=DTYPES[cfg.model.dtype], local_files_only=True
            )
        return model, processor, cfg, target.name
    step = ckpt.resolve(target)
    cfg = qconfig.load(config_path or ckpt.run_config_path(step))
    return load_hf(step, cfg), load_processor(cfg), cfg, step.name


def eval_main(args) -> int:
    """``qwenkit eval RUN_OR_CHECKPOINT [--data PATH] [--samples N]``: eval loss, accuracy, JSONL."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.samples is not None and args.samples < 0:
        raise ValueError(f"--samples must be >= 0 (rows to generate), got {args.samples}")
    if args.data is not None and not Path(args.data).expanduser().exists():
        raise FileNotFoundError(f"--data {args.data!r}: no such file or directory")
    model, processor, cfg, name = load_for_eval(args.target, args.config)
    if args.data is not None:
        # training's checks and messages: unreadable files, data.on_bad_sample, data.max_bad_fraction
        dataset, _ = qdata.read_checked(cfg.data, processor, args.data)
        if len(dataset) == 0:
            raise qdata.DataError(f"--data {args.data!r}: no usable rows")
    else:
        dataset = qdata.build(cfg, processor).eval_dataset
        if dataset is None:
            raise ValueError(
                "the run's config gives no eval set (data.eval_path, data.eval_fraction or "
                "data.tiny_eval_samples); pass --data PATH"
            )
    samples = cfg.train.eval_samples if args.samples is None else args.samples
    collator = qdata.Collator(processor)
    loss = eval_loss(model, dataset, collator, cfg.train.micro_batch_size, 0, 1, torch.device("cpu"))
    rows = qgen.generate_rows(model, dataset, list(range(min(samples, len(dataset)))), cfg.train.eval_max_new_tokens)
    out = Path(args.out) if args.out else Path(args.target) / "eval" / f"cli-{name}.jsonl"
    qgen.write_jsonl(rows, out)
    print(f"eval_loss {loss:.4f}")
    print(f"eval_accuracy {qgen.accuracy(rows):.4f} ({sum(r.match for r in rows)}/{len(rows)} exact matches)")
    print(f"generations: {out}")
    return 0
