"""Typed run configuration: dataclasses, YAML loading, dotted overrides, one validation pass.

A run is described by ``params/*.yaml`` plus command-line overrides such as ``train.steps=30``.
:func:`load` turns them into a :class:`Config` and validates everything (unknown keys, types,
ranges, illegal combinations) *before* any model is built. All problems found are reported
together in one :class:`ConfigError`, each naming the key path, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import torch
import yaml

Dtype = Literal["float32", "bfloat16", "float16"]
# qwenkit.data.layouts.NAMES (the data floor sits above this module; a test keeps the two equal)
DATA_LAYOUTS = (
    "auto", "messages", "sharegpt", "llava", "typed", "qwen_vl", "swift_conversation", "swift_query", "alpaca",
    "cauldron",
)  # fmt: skip
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # Dtype -> torch
log = logging.getLogger(__name__)

# The allowed names: the schema owns them, and the code that implements them (qwenkit.patches,
# qwenkit.model.loss) imports them from here, so config stays a leaf.
FUSED_OPS = ("rms_norm", "vision_rope", "swiglu")  # model.fused_ops; qwenkit.patches implements them
FUSED_BACKENDS = ("auto", "npu", "cuda")  # model.fused_backend
FUSED_LIBRARIES = {"npu": "torch_npu", "cuda": "liger_kernel"}  # backend -> the library its kernels import
PIP_NAMES = {"torch_npu": "torch_npu", "liger_kernel": "liger-kernel"}  # import name -> what to install
TRAINING_LOSS_TYPES = ("token_mean", "sample_mean")  # what the chunked head computes
LOSS_TYPES = (*TRAINING_LOSS_TYPES, "raw")  # loss.loss_type; raw (unreduced, per token): an API output, not for training
MODEL_NAMES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # model.name; qwenkit.model.family holds one entry each
OBJECTIVES = ("sft", "dpo")  # train.objective
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "simpo")  # dpo.loss; qwenkit.model.preference_loss implements them


class ConfigError(ValueError):
    """One or more configuration problems; the message lists each with its key path."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        if len(problems) == 1:  # one line, as every subcommand reports a user error
            super().__init__(f"invalid configuration: {problems[0]}")
        else:
            super().__init__("invalid configuration:\n  - " + "\n  - ".join(problems))


@dataclass
class ModelConfig:
    # the model family (qwenkit.model.family.FAMILIES); auto: the checkpoint's config.json model_type
    # (path=tiny: qwen2_5_vl). A name that disagrees with the checkpoint is refused before start
    name: Literal[("auto", *MODEL_NAMES)] = "auto"
    path: str = "tiny"  # "tiny" (embedded default) or a Hugging Face checkpoint directory
    dtype: Dtype = "float32"  # dtype the weights are loaded in
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    freeze: list[str] = field(default_factory=list)  # module paths, e.g. ["model.visual"]
    fused_ops: Literal["auto", "off"] | list[str] = "auto"  # or a subset of FUSED_OPS
    # auto: NPU tensors run torch_npu, CUDA tensors Liger (when installed); npu | cuda: that route only
    fused_backend: Literal[FUSED_BACKENDS] = "auto"
    init_device: Literal["cpu", "meta"] = "cpu"  # meta: build empty, shard, then load weights into shards
    tie_word_embeddings: bool = False  # only for path=tiny (HF checkpoints carry their own)


@dataclass
class DataConfig:
    path: str = "tiny"  # "tiny" (embedded synthetic set), a JSON/JSONL file, a directory, or an HF dataset dir
    layout: Literal[DATA_LAYOUTS] = "auto"  # row layout (docs/DATA.md); auto: detected per row
    image_dir: str | None = None  # base for relative image paths (default: the dataset file's directory)
    system_prompt: str | None = None  # rows without a system turn; None: the family's (Qwen2.5-VL's default text, Qwen3-VL none)
    max_length: int = 1024  # tokens per sample, images included
    truncate_text: bool = False  # over-long samples: cut text after the last image instead of dropping
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 256
    min_image_side: int = 28  # smaller images are bad samples
    max_aspect_ratio: float = 200.0  # Qwen2-VL's processor refuses more extreme images
    video_dir: str | None = None  # base for relative video paths (default: data.image_dir, else the file's directory)
    video_fps: float = 2.0  # frames sampled per second of video
    video_min_frames: int = 4  # videos with fewer decodable frames are bad samples (short_video)
    video_max_frames: int = 128  # sampled frames per video at most (longer videos are sampled sparser)
    video_max_pixels: int = 28 * 28 * 128  # per frame; the lower bound is data.min_pixels
    video_total_pixels: int = 28 * 28 * 2048  # per video, all frames: caps a video near this/784 tokens
    on_bad_sample: Literal["error", "skip"] = "skip"
    max_bad_fraction: float = 0.01  # training fails if more than this fraction is skipped
    shuffle: bool = True
    num_workers: int = 0
    packing: bool = False  # padding-free: each micro-batch is one row of its samples, attention kept per sample
    max_tokens_per_batch: int = 0  # >0: fill micro-batches up to this many tokens (train.micro_batch_size unused)
    tiny_samples: int = 64  # size of the embedded synthetic dataset (path=tiny)
    cache_dir: str | None = None  # prepared-index cache; None: $QWENKIT_CACHE/data-index (~/.cache/qwenkit/data-index)
    fingerprint: Literal["stat", "content"] = "stat"  # data files keyed by path/size/mtime, or by a content hash
    num_proc: int = 1  # scan processes per rank on a cold cache (rows are also split across ranks)
    verify_images: Literal["header", "full"] = "header"  # scan: header (+ end marker) or a full decode
    eval_path: str | None = None  # held-out set, any format data.path takes
    eval_fraction: float = 0.0  # or hold out this fraction of data.path's rows (split by train.seed)
    tiny_eval_samples: int = 0  # path=tiny: held-out synthetic rows drawn with another seed (0: none)


@dataclass
class LossConfig:
    chunk: bool = True  # chunked cross-entropy in the lm_head: full [B, S, V] logits never exist
    chunk_size: int | Literal["auto"] = "auto"  # labelled tokens per logits chunk (ignored ones are skipped)
    chunk_budget_mb: int = 512  # memory budget of one fp32 logits chunk, for chunk_size=auto
    # "raw" (unreduced per-token loss) is an API output (model.configure_loss), never a training loss
    loss_type: Literal[LOSS_TYPES] = "token_mean"


@dataclass
class ParallelConfig:
    nproc: int = 1  # processes on this node (torchrun --nproc-per-node)
    allow_oversubscribe: bool = False  # CPU: allow more ranks than cores (each rank then gets a share of one)
    backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    shard_patterns: list[str] = field(
        default_factory=lambda: [
            "model.visual.blocks.*",
            "model.visual.merger",
            "model.language_model.embed_tokens",
            "model.language_model.layers.*",
            "lm_head",
        ]
    )
    reshard_after_forward: bool = True
    param_dtype: Dtype | None = None  # FSDP2 MixedPrecisionPolicy; None keeps the weights' dtype
    reduce_dtype: Dtype | None = None
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: params, grads and optimizer state on host
    hsdp_replicas: int = 1  # >1: HSDP mesh (replicas, world // replicas); must divide the world size
    recompute: list[str] = field(default_factory=list)  # e.g. [model.language_model.layers.*]
    activation_offload: bool = False  # saved activations to host memory
    # Ulysses sequence parallelism: groups of sp_size ranks split every sequence (1 = off);
    # data parallelism over nproc // sp_size groups. See docs/SEQUENCE_PARALLEL.md
    sp_size: int = 1
    # a collective (or the process group's start) waiting longer than this fails, naming the
    # rank that stopped answering; long enough for a 7B weight load or checkpoint save
    timeout_s: int = 600


@dataclass
class LoraConfig:
    r: int = 0  # adapter rank; 0: LoRA off (every weight not in model.freeze trains)
    alpha: float = 16.0  # LoRA scaling is alpha / r (alpha / sqrt(r) with use_rslora)
    dropout: float = 0.0  # on the adapters' input
    # "all-linear": every nn.Linear of the language model (never lm_head); or a list of names
    # (q_proj: that last segment) and dotted paths with * per segment (model.language_model.layers.*.mlp.down_proj)
    target_modules: Literal["all-linear"] | list[str] = "all-linear"
    vision: bool = False  # also adapt the linears of the vision blocks (model.visual.blocks.*)
    modules_to_save: list[str] = field(default_factory=list)  # module paths trained fully, e.g. [model.visual.merger]
    use_dora: bool = False  # weight-decomposed LoRA (peft's DoRA)
    use_rslora: bool = False  # rank-stabilised scaling alpha / sqrt(r)


@dataclass
class ParamGroupConfig:
    pattern: str = ""  # a module path, * = one segment (model.visual.blocks.*); its parameters form the group
    lr: float = 0.0  # this group's peak LR (same warmup + cosine shape as train.lr)
    weight_decay: float | None = None  # None: train.weight_decay


@dataclass
class TrainConfig:
    objective: Literal[OBJECTIVES] = "sft"  # sft: the replies' cross-entropy; dpo: preference pairs (the dpo section)
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
    # also eval_accuracy every N steps (0: step 0 and the end only); each one gathers the full
    # weights on every rank, and each rank generates its share of the rows
    eval_accuracy_every: int = 0
    eval_max_new_tokens: int = 32  # generation length limit for eval_accuracy
    eval_batch_size: int = 8  # prompts per generate call on each rank (left-padded; 1: one row at a time)
    eval_temperature: float = 0.0  # 0: greedy; > 0 samples (seeded by train.seed and the rank)
    eval_top_p: float = 1.0  # nucleus sampling's mass when eval_temperature > 0
    # scores of each reply: exact, normalized (VQA), relaxed (ChartQA), anls (DocVQA) or a user's
    # module:function(prediction, reference) -> float; eval_accuracy is the first one's mean
    eval_metrics: list[str] = field(default_factory=lambda: ["exact"])
    report_to: list[Literal["tensorboard", "mlflow"]] = field(default_factory=list)  # besides the metrics JSONL


@dataclass
class DpoConfig:
    """Preference tuning (``train.objective: dpo``); the losses are in :mod:`qwenkit.model.preference_loss`."""

    beta: float = 0.1  # strength of the pull towards the reference (SimPO: the reward scale)
    loss: Literal[DPO_LOSSES] = "sigmoid"  # sigmoid (DPO), ipo, hinge (SLiC), simpo (no reference, length-normalised)
    gamma: float = 0.0  # simpo only: the target reward margin
    label_smoothing: float = 0.0  # sigmoid / simpo: the share of pairs assumed flipped (conservative DPO)
    sft_weight: float = 0.0  # > 0: add this x the chosen replies' token-mean cross-entropy (RPO, pref_ftx)
    # one pass before training writes the reference's log-probs of every pair next to the data
    # index (keyed by its fingerprint); no reference forward in training, no reference copy
    precompute_ref: bool = False


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (0: only at the end)
    keep_last: int = 2
    save_final: bool = True
    load_optimizer: bool = True
    load_rng: bool = True
    # YAML key checkpoint.async (a Python keyword, hence the field's name): stage the state to CPU
    # memory and write it in the background (DCP async_save) while training goes on
    async_save: bool = field(default=False, metadata={"key": "async"})


@dataclass
class ProfileConfig:
    enabled: bool = False  # torch.profiler window
    wait: int = 1
    warmup: int = 1
    active: int = 2
    memory_snapshot: bool = False  # CUDA/NPU allocator history; peak RSS on CPU is always recorded


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Loading


class Loader(yaml.SafeLoader):
    """PyYAML's safe loader with the values people type read as they mean them (YAML 1.2's core schema).

    PyYAML implements YAML 1.1: ``1e-4`` (no dot) is a string there, and ``off``/``no``/``on``/
    ``yes`` are booleans, so ``train.lr: 1e-4`` and ``model.fused_ops: off`` were refused. Here
    every exponent spelling is a float, only ``true``/``false`` are booleans (a bool field still
    takes yes/no/on/off, see :func:`_coerce`), and a key given twice in one mapping is warned about.
    """

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str) and key in seen:
                log.warning(
                    "%s: key %r given twice (lines %d and %d); the last one is used",
                    self.name, key, seen[key] + 1, key_node.start_mark.line + 1,
                )  # fmt: skip
            seen.setdefault(key, key_node.start_mark.line)
        return super().construct_mapping(node, deep=deep)


# Drop YAML 1.1's bool and float resolvers, then add YAML 1.2's (floats also with underscores,
# as Python's float() and YAML 1.1 take them).
Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9][0-9_]*)?
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9][0-9_]*)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9][0-9_]*
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
# YAML 1.1's bool words, which a bool field still takes (PyYAML read them as booleans before)
BOOL_WORDS = {"yes": True, "on": True, "no": False, "off": False}


def parse_yaml(text: str, name: str = "<override>") -> Any:
    """``text`` read with :class:`Loader`; ``name`` (a file) is what a duplicate-key warning names."""
    loader = Loader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> Config:
    """Read a YAML file (or start from defaults), apply overrides, validate, return a Config."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([f"config file {str(path)!r} does not exist"])
        try:
            raw = parse_yaml(path.read_text(), str(path))
        except yaml.YAMLError as e:
            raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
        if raw is None:
            log.warning("%s is empty: the run uses the built-in defaults (see qwenkit/config.py)", path)
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError([f"{path}: top level must be a mapping, got {type(raw).__name__}"])
    problems: list[str] = []
    for key, value in _parse_overrides(overrides, problems):
        _set_dotted(raw, key, value, problems)
    cfg = _build(Config, raw, "", problems)
    if not problems:
        problems.extend(validate(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


def write_config(cfg: Config, output_dir: str | Path) -> Path:
    """``<output_dir>/config.yaml``: the resolved config every rank reads and ``qwenkit export`` finds.

    Written to a temporary name and renamed, so a reader never sees half a file.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "config.yaml"
    tmp = path.with_name(f".config.yaml.{os.getpid()}")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, path)
    return path


def _parse_overrides(overrides, problems: list[str]):
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return list(overrides.items())
    pairs, seen = [], {}
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {item!r} must look like key.path=value")
            continue
        key, text = item.split("=", 1)
        key = key.strip()
        try:
            value = parse_yaml(text) if text.strip() else ""
        except yaml.YAMLError as e:
            problems.append(f"override {item!r}: not valid YAML: {str(e).splitlines()[0]}")
            continue
        if key in seen:
            log.warning("override %s given twice (%r, then %r); the last one is used", key, seen[key], text)
        seen[key] = text
        pairs.append((key, value))
    return pairs


def _set_dotted(raw: dict, key: str, value: Any, problems: list[str]) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            problems.append(f"override {key!r}: {'.'.join(parts[: i + 1])} is not a section")
            return
        node = nxt
    node[parts[-1]] = value


def _build(cls, raw: Any, prefix: str, problems: list[str]):
    where = prefix.rstrip(".") or "<top level>"
    if not isinstance(raw, dict):
        problems.append(f"{where} must be a mapping, got {raw!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    spelled = {f.metadata["key"]: f.name for f in dataclasses.fields(cls) if "key" in f.metadata}  # checkpoint.async
    raw = {spelled.get(k, k): v for k, v in raw.items()}
    for key in raw:
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix + near[0]!r}?" if near else f"; allowed: {', '.join(names)}"
            problems.append(f"unknown key {prefix + str(key)!r}{hint}")
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, raw[name], f"{prefix}{name}.", problems)
            continue
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if dataclasses.is_dataclass(item):  # a list of sections, e.g. train.param_groups
            if isinstance(raw[name], list):
                kwargs[name] = [_build(item, r, f"{prefix}{name}[{i}].", problems) for i, r in enumerate(raw[name])]
            else:
                problems.append(f"{prefix}{name}: got {raw[name]!r}, expected a list of mappings")
            continue
        ok, value = _coerce(raw[name], hint)
        if ok:
            kwargs[name] = value
        else:
            problems.append(f"{prefix}{name}: got {raw[name]!r}, expected {_describe(hint)}{_bool_hint(raw[name], hint)}")
    return cls(**kwargs)


def _coerce(value: Any, hint) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return True, value
    if origin in (Union, types.UnionType):
        for arg in args:
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, None
    if origin is Literal:
        return (value in args and type(value) is type(next(a for a in args if a == value))), value
    if hint is type(None):
        return value is None, None
    if origin is list:
        if not isinstance(value, list):
            return False, None
        out = []
        for item in value:
            ok, v = _coerce(item, args[0])
            if not ok:
                return False, None
            out.append(v)
        return True, out
    if hint is bool:
        if isinstance(value, str) and value.lower() in BOOL_WORDS:
            return True, BOOL_WORDS[value.lower()]
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # every spelling Python's float() takes ("1e-4", "infinity", " 2E5 ")
            try:
                return True, float(value)
            except ValueError:
                return False, None
        return False, None
    if hint is str:
        return isinstance(value, str), value
    return isinstance(value, hint), value


def _wants_str(hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_wants_str(a) for a in args)
    return hint is str or (origin is Literal and any(isinstance(a, str) for a in args))


def _bool_hint(value: Any, hint) -> str:
    """The reason a bare ``false`` was refused where a string is meant: YAML made it a boolean."""
    if isinstance(value, bool) and _wants_str(hint):
        return f" (YAML reads a bare {str(value).lower()} as a boolean; quote it, e.g. '{str(value).lower()}', to mean the string)"
    return ""


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is type(None):
        return "null"
    if origin is list:
        return f"a list of {_describe(args[0])}"
    return getattr(hint, "__name__", str(hint))


# ---------------------------------------------------------------------------------------------
# Checks shared with the code that takes the same values through its Python API (patches.apply,
# model.configure_loss, the chunked loss): one message each, prefixed here with the key path.


def installed(library: str) -> bool:
    """Whether ``library`` can be imported, without importing it."""
    if sys.modules.get(library) is not None:
        return True
    try:
        return importlib.util.find_spec(library) is not None
    except ValueError:  # in sys.modules with no spec
        return False


def fused_ops_problems(ops: Any) -> list[str]:
    """What is wrong with a ``model.fused_ops`` value (``auto``, ``off`` or a list of FUSED_OPS)."""
    if ops in ("auto", "off"):
        return []
    if isinstance(ops, str) or not isinstance(ops, (list, tuple)) or not all(isinstance(o, str) for o in ops):
        return [f"fused ops must be 'auto', 'off' or a list of {', '.join(FUSED_OPS)}; got {ops!r}"]
    return [f"unknown fused op {op!r}; allowed: {', '.join(FUSED_OPS)}" for op in ops if op not in FUSED_OPS]


def fused_backend_problem(backend: str) -> str | None:
    """Why ``model.fused_backend`` cannot run here (not a backend, or its library is missing), or None."""
    if backend not in FUSED_BACKENDS:
        return f"fused_backend must be one of {', '.join(FUSED_BACKENDS)}, got {backend!r}"
    library = FUSED_LIBRARIES.get(backend)
    if library is None or installed(library):
        return None
    return (
        f"fused_backend={backend!r} needs {PIP_NAMES[library]}, which is not installed: "
        f"pip install 'qwenkit[{backend}]', or use auto (each tensor's device picks its kernels)"
    )


def chunk_size_problem(chunk_size: Any) -> str | None:
    """Why a ``loss.chunk_size`` value is refused (a positive int or ``auto``), or None."""
    if chunk_size == "auto" or (isinstance(chunk_size, int) and chunk_size > 0):
        return None
    return f"chunk_size must be a positive int or 'auto', got {chunk_size!r}"


# ---------------------------------------------------------------------------------------------
# Ranges and illegal combinations


def validate(cfg: Config) -> list[str]:
    """Every range and cross-field rule, section by section; returns the problems (empty when valid)."""
    problems: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(msg)

    for check in (_check_finite, _check_model, _check_data, _check_loss, _check_parallel, _check_train,
                  _check_lora, _check_dpo, _check_checkpoint, _check_profile):  # fmt: skip
        check(cfg, need)
    return problems


def _check_finite(cfg: Config, need) -> None:
    """No float setting is inf or nan (``train.lr: .inf`` would pass ``lr > 0``)."""
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                need(False, f"{section.name}.{f.name} must be a finite number, got {value}")


def _check_model(cfg: Config, need) -> None:
    model = cfg.model
    for problem in fused_ops_problems(model.fused_ops):
        need(False, f"model.fused_ops: {problem}")
    if model.fused_ops != "off":
        problem = fused_backend_problem(model.fused_backend)
        need(problem is None, f"model.{problem}")


def _check_data(cfg: Config, need) -> None:
    data, loss = cfg.data, cfg.loss
    need(data.max_length > 0, f"data.max_length must be > 0, got {data.max_length}")
    need(data.min_pixels > 0, f"data.min_pixels must be > 0, got {data.min_pixels}")
    need(
        data.max_pixels >= data.min_pixels,
        f"data.max_pixels must be >= data.min_pixels ({data.min_pixels}), got {data.max_pixels}",
    )
    need(data.min_image_side >= 1, f"data.min_image_side must be >= 1, got {data.min_image_side}")
    need(data.max_aspect_ratio >= 1, f"data.max_aspect_ratio must be >= 1, got {data.max_aspect_ratio}")
    need(data.video_fps > 0, f"data.video_fps must be > 0, got {data.video_fps}")
    need(
        data.video_min_frames >= 2,
        f"data.video_min_frames must be >= 2 (one temporal patch), got {data.video_min_frames}",
    )
    need(
        data.video_max_frames >= data.video_min_frames,
        f"data.video_max_frames must be >= data.video_min_frames ({data.video_min_frames}), got {data.video_max_frames}",
    )
    need(
        data.video_max_pixels >= data.min_pixels,
        f"data.video_max_pixels must be >= data.min_pixels ({data.min_pixels}), got {data.video_max_pixels}",
    )
    need(
        data.video_total_pixels >= data.min_pixels,
        f"data.video_total_pixels must be >= data.min_pixels ({data.min_pixels}), got {data.video_total_pixels}",
    )
    need(
        0.0 <= data.max_bad_fraction <= 1.0,
        f"data.max_bad_fraction must be in [0, 1], got {data.max_bad_fraction}",
    )
    need(data.num_workers >= 0, f"data.num_workers must be >= 0, got {data.num_workers}")
    need(data.tiny_samples > 0, f"data.tiny_samples must be > 0, got {data.tiny_samples}")
    need(data.max_tokens_per_batch >= 0, f"data.max_tokens_per_batch must be >= 0 (0: off), got {data.max_tokens_per_batch}")
    if data.max_tokens_per_batch:
        need(
            data.max_tokens_per_batch >= data.max_length,
            f"data.max_tokens_per_batch={data.max_tokens_per_batch} is below data.max_length={data.max_length}: "
            "a sample of the longest allowed length would fit in no micro-batch",
        )
    if data.packing:
        need(
            loss.loss_type != "sample_mean",
            "loss.loss_type: 'sample_mean' is not available with data.packing=true "
            "(a packed row is one row of several samples); use token_mean or data.packing=false",
        )
    need(data.num_proc >= 1, f"data.num_proc must be >= 1, got {data.num_proc}")
    need(0.0 <= data.eval_fraction < 1.0, f"data.eval_fraction must be in [0, 1), got {data.eval_fraction}")
    need(
        data.eval_path is None or data.eval_fraction == 0.0,
        f"data.eval_path ({data.eval_path!r}) and data.eval_fraction ({data.eval_fraction}) both give an eval set; keep one",
    )
    need(data.tiny_eval_samples >= 0, f"data.tiny_eval_samples must be >= 0, got {data.tiny_eval_samples}")


def _check_loss(cfg: Config, need) -> None:
    loss = cfg.loss
    problem = chunk_size_problem(loss.chunk_size)
    need(problem is None, f"loss.{problem}")
    need(loss.chunk_budget_mb > 0, f"loss.chunk_budget_mb must be > 0, got {loss.chunk_budget_mb}")
    need(
        loss.loss_type != "raw",
        "loss.loss_type: 'raw' (unreduced per-token loss) is an API output "
        "(model.configure_loss(loss_type='raw')), not a training loss; use token_mean or sample_mean",
    )


def _check_parallel(cfg: Config, need) -> None:
    parallel = cfg.parallel
    need(parallel.nproc >= 1, f"parallel.nproc must be >= 1, got {parallel.nproc}")
    need(parallel.hsdp_replicas >= 1, f"parallel.hsdp_replicas must be >= 1, got {parallel.hsdp_replicas}")
    need(parallel.timeout_s >= 1, f"parallel.timeout_s must be >= 1 (seconds), got {parallel.timeout_s}")
    _check_sequence_parallel(cfg, need)


def _check_sequence_parallel(cfg: Config, need) -> None:
    """``parallel.sp_size``; the model's head counts are checked by the launcher (they need its config)."""
    sp = cfg.parallel.sp_size
    need(sp >= 1, f"parallel.sp_size must be >= 1, got {sp}")
    if sp <= 1:
        return
    need(
        cfg.parallel.nproc % sp == 0,
        f"parallel.sp_size={sp} must divide parallel.nproc={cfg.parallel.nproc} (a sequence-parallel group stays on one node)",
    )
    need(cfg.loss.chunk, f"parallel.sp_size={sp} needs loss.chunk=true (each rank computes the chunked loss of its slice)")
    need(
        cfg.loss.loss_type == "token_mean",
        f"parallel.sp_size={sp} supports loss.loss_type=token_mean only, got {cfg.loss.loss_type!r}",
    )
    need(
        cfg.model.attn_implementation in ("sdpa", "eager"),
        f"parallel.sp_size={sp} supports model.attn_implementation sdpa or eager, got {cfg.model.attn_implementation!r}",
    )


def _check_train(cfg: Config, need) -> None:
    train = cfg.train
    need(train.steps > 0, f"train.steps must be > 0, got {train.steps}")
    need(
        0 <= train.stop_after <= train.steps,
        f"train.stop_after must be in [0, train.steps={train.steps}], got {train.stop_after}",
    )
    need(train.micro_batch_size > 0, f"train.micro_batch_size must be > 0, got {train.micro_batch_size}")
    need(train.grad_accum > 0, f"train.grad_accum must be > 0, got {train.grad_accum}")
    need(train.lr > 0, f"train.lr must be > 0, got {train.lr}")
    need(0.0 <= train.min_lr_ratio <= 1.0, f"train.min_lr_ratio must be in [0, 1], got {train.min_lr_ratio}")
    need(train.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {train.warmup_steps}")
    if train.warmup_steps > train.steps > 0:
        log.warning(
            "train.warmup_steps=%d exceeds train.steps=%d: the LR rises for the whole run and never reaches train.lr=%g",
            train.warmup_steps, train.steps, train.lr,
        )  # fmt: skip
    need(
        bool(train.output_dir.strip()),
        f"train.output_dir must name a directory, got {train.output_dir!r} "
        "(empty: config.yaml, checkpoints/, logs/ and metrics/ would land in the current directory)",
    )
    need(train.weight_decay >= 0, f"train.weight_decay must be >= 0, got {train.weight_decay}")
    need(
        len(train.betas) == 2 and all(0.0 <= b < 1.0 for b in train.betas),
        f"train.betas must be two numbers in [0, 1), got {train.betas}",
    )
    need(train.max_grad_norm >= 0, f"train.max_grad_norm must be >= 0, got {train.max_grad_norm}")
    need(train.log_every >= 1, f"train.log_every must be >= 1, got {train.log_every}")
    need(train.eval_every >= 0, f"train.eval_every must be >= 0, got {train.eval_every}")
    need(train.eval_samples >= 0, f"train.eval_samples must be >= 0, got {train.eval_samples}")
    need(train.eval_accuracy_every >= 0, f"train.eval_accuracy_every must be >= 0, got {train.eval_accuracy_every}")
    need(train.eval_max_new_tokens >= 1, f"train.eval_max_new_tokens must be >= 1, got {train.eval_max_new_tokens}")
    need(train.eval_batch_size >= 1, f"train.eval_batch_size must be >= 1, got {train.eval_batch_size}")
    need(train.eval_temperature >= 0, f"train.eval_temperature must be >= 0 (0: greedy), got {train.eval_temperature}")
    need(0 < train.eval_top_p <= 1, f"train.eval_top_p must be in (0, 1], got {train.eval_top_p}")
    for problem in eval_metric_problems(train.eval_metrics, "train.eval_metrics"):
        need(False, problem)
    need(
        "mlflow" not in train.report_to or importlib.util.find_spec("mlflow") is not None,
        "train.report_to: mlflow needs the mlflow package, which is not installed; pip install 'qwenkit[mlflow]'",
    )
    _check_param_groups(cfg, need)


EVAL_METRICS = ("exact", "normalized", "relaxed", "anls")  # built-in answer scores (qwenkit.engine.answers)


def load_user_metric(spec: str, key: str = "train.eval_metrics"):
    """The function ``module:function`` names (importable from ``PYTHONPATH``); a ``ValueError``
    naming ``key`` when it does not import or is not callable."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{key}: {spec!r} is neither a built-in metric ({', '.join(EVAL_METRICS)}) nor module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:  # a user's module may fail in any way: say which
        raise ValueError(f"{key}: {spec!r} does not import ({type(e).__name__}: {e}); is its folder on PYTHONPATH?") from e
    if not callable(fn):
        raise ValueError(f"{key}: {spec!r} is a {type(fn).__name__}, not a function(prediction, reference) -> float")
    return fn


def eval_metric_problems(names: list[str], key: str) -> list[str]:
    """Why ``names`` cannot score replies: none given, unknown, not importable, or two reported alike."""
    if not names:
        return [f"{key} must name at least one metric ({', '.join(EVAL_METRICS)} or module:function)"]
    problems, reported = [], []
    for spec in names:
        if spec in EVAL_METRICS:
            reported.append(spec)
            continue
        try:
            reported.append(load_user_metric(spec, key).__name__)
        except ValueError as e:
            problems.append(str(e))
    twice = sorted({r for r in reported if reported.count(r) > 1})
    if twice:
        problems.append(f"{key}: {', '.join(twice)} reported twice (a user metric is reported under its function's name)")
    return problems


def _check_param_groups(cfg: Config, need) -> None:
    seen = set()
    for i, group in enumerate(cfg.train.param_groups):
        key = f"train.param_groups[{i}]"
        need(bool(group.pattern), f"{key}.pattern must be a module path, e.g. model.visual.blocks.*")
        need(group.pattern not in seen, f"{key}.pattern {group.pattern!r} is given twice")
        seen.add(group.pattern)
        need(group.lr > 0, f"{key}.lr must be > 0, got {group.lr}")
        if group.weight_decay is not None:
            need(group.weight_decay >= 0, f"{key}.weight_decay must be >= 0, got {group.weight_decay}")


def _check_lora(cfg: Config, need) -> None:
    """Ranges and combinations; target and module paths are checked against the model tree
    (:func:`qwenkit.launch.check_module_paths`)."""
    lora = cfg.lora
    need(lora.r >= 0, f"lora.r must be >= 0 (0: off), got {lora.r}")
    if lora.r == 0:
        default = LoraConfig()
        changed = [k for k in ("target_modules", "vision", "modules_to_save", "use_dora", "use_rslora")
                   if getattr(lora, k) != getattr(default, k)]  # fmt: skip
        need(not changed, f"lora.{', lora.'.join(changed)} set but lora.r=0 (LoRA off); set lora.r > 0")
        return
    need(lora.alpha > 0, f"lora.alpha must be > 0, got {lora.alpha}")
    need(0.0 <= lora.dropout < 1.0, f"lora.dropout must be in [0, 1), got {lora.dropout}")
    if isinstance(lora.target_modules, list):
        need(bool(lora.target_modules), "lora.target_modules must not be empty (or 'all-linear')")
        need("lm_head" not in lora.target_modules,
             "lora.target_modules: lm_head computes the chunked loss and takes no adapter; "
             "train it fully with lora.modules_to_save=[lm_head]")  # fmt: skip
    need(
        not (lora.use_dora and cfg.model.init_device == "meta"),
        "lora.use_dora=true needs model.init_device=cpu: DoRA's magnitude is computed from the full "
        "base weights when the adapters are added, which meta init does not have yet",
    )


def _check_dpo(cfg: Config, need) -> None:
    """``train.objective`` and the ``dpo`` section, and what preference pairs cannot go with."""
    dpo = cfg.dpo
    if cfg.train.objective != "dpo":
        changed = [f.name for f in dataclasses.fields(DpoConfig) if getattr(dpo, f.name) != f.default]
        need(not changed, f"dpo.{', dpo.'.join(changed)} set but train.objective={cfg.train.objective!r}; set train.objective=dpo")
        return
    need(dpo.beta > 0, f"dpo.beta must be > 0, got {dpo.beta}")
    need(0.0 <= dpo.label_smoothing < 0.5, f"dpo.label_smoothing must be in [0, 0.5), got {dpo.label_smoothing}")
    need(
        dpo.label_smoothing == 0 or dpo.loss in ("sigmoid", "simpo"),
        f"dpo.label_smoothing applies to dpo.loss sigmoid or simpo, not {dpo.loss!r}",
    )
    need(dpo.gamma >= 0, f"dpo.gamma must be >= 0, got {dpo.gamma}")
    need(dpo.gamma == 0 or dpo.loss == "simpo", f"dpo.gamma (the SimPO margin) applies to dpo.loss=simpo, not {dpo.loss!r}")
    need(dpo.sft_weight >= 0, f"dpo.sft_weight must be >= 0, got {dpo.sft_weight}")
    need(
        not (dpo.precompute_ref and dpo.loss == "simpo"),
        "dpo.precompute_ref=true with dpo.loss=simpo: SimPO has no reference model to precompute",
    )
    need(cfg.loss.chunk, "train.objective=dpo needs loss.chunk=true: the per-sequence log-probs come from the chunked head")
    need(
        not cfg.data.packing,
        "train.objective=dpo does not support data.packing=true: a pair's two replies are two rows of one micro-batch "
        "(the per-sequence log-probs are row sums); use data.packing=false",
    )
    need(
        not cfg.data.max_tokens_per_batch,
        "train.objective=dpo does not support data.max_tokens_per_batch yet (the token-budget sampler deals samples, "
        "not pairs); use train.micro_batch_size (pairs per micro-batch)",
    )
    need(
        cfg.parallel.sp_size == 1,
        f"train.objective=dpo does not support parallel.sp_size={cfg.parallel.sp_size}: a sequence's log-prob would be "
        "split over the ranks of its group; use parallel.sp_size=1",
    )
    need(
        cfg.data.eval_fraction == 0.0,
        "train.objective=dpo does not support data.eval_fraction (it would split rows, not pairs); "
        "hold out pairs with data.eval_path",
    )
    need(
        cfg.data.layout == "auto",
        f"train.objective=dpo reads the preference layouts (TRL, LLaMA-Factory, ms-swift; docs/DATA.md) per row: "
        f"data.layout must be auto, got {cfg.data.layout!r}",
    )


def _check_checkpoint(cfg: Config, need) -> None:
    ckpt = cfg.checkpoint
    need(ckpt.every >= 0, f"checkpoint.every must be >= 0, got {ckpt.every}")
    need(ckpt.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {ckpt.keep_last}")
    if ckpt.async_save:
        import torch.distributed.checkpoint as dcp

        need(hasattr(dcp, "async_save"), f"checkpoint.async=true needs torch.distributed.checkpoint.async_save "
             f"(torch >= 2.4), this torch is {torch.__version__}: set checkpoint.async=false or upgrade torch")  # fmt: skip


def _check_profile(cfg: Config, need) -> None:
    profile = cfg.profile
    for name in ("wait", "warmup"):
        need(getattr(profile, name) >= 0, f"profile.{name} must be >= 0, got {getattr(profile, name)}")
    need(profile.active >= 1, f"profile.active must be >= 1, got {profile.active}")
