"""``train``: the objective, the schedule and optimizer, the output folder and resume, evaluation
and its answer metrics, the trackers."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Literal

from qwenkit.config.vllm import Engine

# what an objective's rows are to the data side (qwenkit.data.pipeline, qwenkit.data.check):
# conversations ending with a reply; preference pairs (two replies to one prompt, qwenkit.data.preference);
# prompts with a reference (the last reply, or a 'solution' / 'answer' column; a row may then be a prompt alone)
DATA_READS = ("conversations", "pairs", "prompts")


@dataclass(frozen=True)
class ObjectiveEntry:
    path: str  # its class (a subclass of qwenkit.engine.objective.Objective) as module:Class
    reads: Literal[DATA_READS]  # what it trains on, one of DATA_READS


# train.objective: the one registry of objectives, each name's entry by import path, so this leaf
# names them without importing the engine; the data side asks an entry what its rows are
OBJECTIVES = {
    "sft": ObjectiveEntry("qwenkit.engine.objectives.sft:Sft", "conversations"),
    "dpo": ObjectiveEntry("qwenkit.engine.objectives.dpo:PreferenceObjective", "pairs"),
    "grpo": ObjectiveEntry("qwenkit.engine.objectives.grpo:GrpoObjective", "prompts"),
    "distill": ObjectiveEntry("qwenkit.engine.objectives.distill:DistillObjective", "prompts"),
}

EVAL_METRICS = ("exact", "normalized", "relaxed", "anls")  # built-in answer scores (qwenkit.engine.generation.answers)


@dataclass
class ParamGroupConfig:
    pattern: str = ""  # a module path, * = one segment (model.visual.blocks.*); its parameters form the group
    lr: float = 0.0  # this group's peak LR (same warmup + cosine shape as train.lr)
    weight_decay: float | None = None  # None: train.weight_decay


@dataclass
class TrainConfig:
    # sft: the replies' cross-entropy; dpo: preference pairs (the dpo section); grpo: rollouts scored by rewards (the grpo section);
    # distill: the student's rollouts (the grpo section's sampling keys) scored by a teacher (the distill section)
    objective: Literal[tuple(OBJECTIVES)] = "sft"
    steps: int = 30  # the run's length: the LR schedule spans these steps
    stop_after: int = 0  # at most N more steps per invocation (checkpoint saved, exit 75: run again); 0: to train.steps
    micro_batch_size: int = 2  # samples per rank per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 3
    weight_decay: float = 0.0
    # per-module LRs: the first group whose pattern holds a parameter takes it; the rest train at train.lr
    param_groups: list[ParamGroupConfig] = field(default_factory=list)
    no_decay: bool = False  # biases, norm weights and embeddings get weight_decay 0 (in every group)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    max_grad_norm: float = 1.0  # 0 disables clipping
    seed: int = 42
    output_dir: str = "runs/tiny"
    resume: str = "auto"  # "auto" (newest complete checkpoint), "none", or a checkpoint directory
    # resume (or start fresh) behind newer checkpoints in output_dir: they move to superseded-<time>/
    resume_older: bool = False
    log_every: int = 1
    eval_every: int = 0  # eval loss every N steps; always at step 0 and train.steps when an eval set exists
    eval_samples: int = 16  # eval rows whose greedy replies give eval_accuracy (step 0 and the end); 0: none
    # also eval_accuracy every N steps (0: step 0 and the end only); each rank generates its share
    # of the rows (from a full copy of the weights, or in lockstep: train.eval_generation)
    eval_accuracy_every: int = 0
    eval_max_new_tokens: int = 32  # generation length limit for eval_accuracy
    eval_batch_size: int = 8  # prompts per generate call on each rank (left-padded; 1: one row at a time)
    eval_temperature: float = 0.0  # 0: greedy; > 0 samples (seeded by train.seed and the rank)
    eval_top_p: float = 1.0  # nucleus sampling's mass when eval_temperature > 0
    # where replies come from: gather (a full copy of the weights on every rank), lockstep (the
    # sharded model, every rank stepping together), auto (gather when the copy fits, see engine/generation/generate.py)
    eval_generation: Literal["auto", "gather", "lockstep"] = "auto"
    # what generates the eval replies: hf (train.eval_generation's copy or lockstep) or a colocated vLLM
    # engine per rank, the weights pushed to it (the vllm section; qwenkit.engine.generation.vllm_engine)
    eval_engine: Engine = "hf"
    # scores of each reply: exact, normalized (VQA), relaxed (ChartQA), anls (DocVQA) or a user's
    # module:function(prediction, reference) -> float; eval_accuracy is the first one's mean
    eval_metrics: list[str] = field(default_factory=lambda: ["exact"])
    report_to: list[Literal["tensorboard", "mlflow"]] = field(default_factory=list)  # besides the metrics JSONL


def load_user_metric(spec: str, key: str = "train.eval_metrics", builtins: tuple[str, ...] = EVAL_METRICS,
                     what: str = "metric"):  # fmt: skip
    """The function ``module:function`` names (importable from ``PYTHONPATH``); a ``ValueError``
    naming ``key`` when it is not of that form, does not import or is not callable."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{key}: {spec!r} is neither a built-in {what} ({', '.join(builtins)}) nor module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - a user's module may fail in any way (1/0, a syntax error): say which
        hint = "; is its folder on PYTHONPATH?" if isinstance(e, ImportError) else ""
        raise ValueError(f"{key}: {spec!r} does not import ({type(e).__name__}: {e}){hint}") from e
    if not callable(fn):
        raise ValueError(f"{key}: {spec!r} is a {type(fn).__name__}, not a function(prediction, reference) -> float")
    return fn


def call_problem(fn, spec: str, key: str, what: str = "metric") -> str | None:
    """Why ``fn`` cannot be called as the run calls it: a metric ``f(prediction, reference)``, a reward
    ``f(prediction, reference, **row)`` (the row's other columns as keywords,
    :func:`qwenkit.engine.objectives.rewards.score`); None when it can, or when Python cannot say
    (a builtin without a signature)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = signature.parameters.values()
    takes_row = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    try:
        signature.bind("prediction", "reference")
    except TypeError:
        fits = False
    else:
        fits = takes_row or what != "reward"
    if fits:
        return None
    call = "prediction, reference, **row" if what == "reward" else "prediction, reference"
    return (f"{key}: {spec!r} takes ({', '.join(str(p) for p in params)}), but a {what} is called as "
            f"{fn.__name__}({call}); give it that signature")


def scorer_problems(names: list[str], key: str, builtins: tuple[str, ...] = EVAL_METRICS, what: str = "metric") -> list[str]:
    """Why ``names`` cannot score replies (``train.eval_metrics``, ``--metric``) or completions
    (``grpo.rewards``, ``what="reward"``): none given, unknown, not importable, or two under one name
    (a user's function is reported, and logged, under its own name)."""
    if not names:
        return [f"{key} must name at least one {what} ({', '.join(builtins)} or module:function)"]
    problems, named = [], []
    for spec in names:
        if spec in builtins:
            named.append(spec)
            continue
        try:
            fn = load_user_metric(spec, key, builtins, what)
        except ValueError as e:
            problems.append(str(e))
            continue
        named.append(fn.__name__)
        if problem := call_problem(fn, spec, key, what):
            problems.append(problem)
    twice = sorted({n for n in named if named.count(n) > 1})
    if twice:
        problems.append(f"{key}: {', '.join(twice)} given twice (a user {what} is reported under its function's name)")
    return problems
