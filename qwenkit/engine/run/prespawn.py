"""The checks of a run before any process starts: what would otherwise fail inside every rank.

``qwenkit train`` (:mod:`qwenkit.launch`) and every sweep trial (:mod:`qwenkit.sweep.file`) pass
:func:`check_before_spawn` first: the model directory and its module tree (built on meta: no
weights read), distillation's teacher (:mod:`qwenkit.engine.checkpoints.teacher`), the dataset path and the optional extras the run needs, its bad rows when their index
is cached (:func:`check_prepared_rows`), a dataset too small for one optimizer step
(:func:`check_data_size`), the resume rule
(:func:`qwenkit.engine.checkpoints.resume.decide`: which checkpoint, whole, fitting this run's model,
objective, data and ranks), the number of ranks this node can run, the HSDP shape, GRPO's tools and
environment (:func:`qwenkit.engine.rollouts.tools.problems`).

Light on purpose: neither this module nor its imports load the DCP checkpoint code
(:mod:`qwenkit.engine.checkpoints.dcp`); ``tests/test_launch.py`` checks it in a fresh process.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from qwenkit import config as qconfig
from qwenkit.config.rules import vllm as vllm_rules
from qwenkit.data import cache, load, pipeline, split
from qwenkit.data.conversation import parse_row
from qwenkit.data.load import cached_problem
from qwenkit.data.reader import DataError, open_sources
from qwenkit.device import device_count, resolve_device
from qwenkit.distributed import fsdp, sequence
from qwenkit.engine.checkpoints import resume as resume_rule
from qwenkit.engine.checkpoints import teacher
from qwenkit.engine.generation.vllm_client import ServerGone, ServerRefused, wait_up
from qwenkit.engine.rollouts import tools
from qwenkit.engine.run import optim
from qwenkit.model import lora
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as families
from qwenkit.model.families.vllm_limits import vllm_problem
from qwenkit.model.paths import load_processor, resolve_path


def check_before_spawn(cfg, nodes: int = 1, fewest_nodes: int | None = None) -> list[str]:
    """Problems that would otherwise surface only inside every rank; empty when all is well.
    ``nodes``: how many nodes the job may have (the world the resume rule checks; under c10d the
    most, the ranks check the world they get); ``fewest_nodes``: the fewest it may start on (under
    c10d MIN of MIN:MAX; default ``nodes``), whose smaller step a dataset too small for fails in any case."""
    if problems := families.entry_problems(cfg.model.name, cfg.model.path):  # before any tiny checkpoint is written
        return problems
    try:
        path = resolve_path(cfg.model)  # writes the tiny checkpoint once, before ranks race for it
    except FileNotFoundError as e:
        problems.append(str(e))
    else:  # module paths, LoRA targets, saved modules and parameter-group patterns against the module tree (on meta)
        problems.extend(check_module_paths(cfg))
        problems.extend(families.problems(cfg, path))  # what the family cannot run: SP, packing, fused ops...
        problems.extend(vllm_device_problems(cfg, path))
        problems.extend(vllm_server_problems(cfg, nodes))
        problems.extend(teacher.problems(cfg, path))  # distillation's teacher: there, of the student's tokenizer
        heads = sequence.heads_problem_of(path, cfg.parallel.sp_size)
        if heads:
            problems.append(heads)
    if cfg.data.path != "tiny" and not Path(cfg.data.path).expanduser().exists():
        problems.append(f"data.path={cfg.data.path!r} does not exist")
    else:
        problems.extend(check_extras(cfg))
        processor = indexing_processor(cfg) if not problems else None
        if not problems and (bad := check_prepared_rows(cfg, processor)):
            problems.append(bad)
        if not problems:
            problems.extend(check_data_size(cfg, cfg.parallel.nproc * (fewest_nodes or nodes), processor))
    # tools that do not import, are untyped or share a name (issue 61): none set, none asked
    problems.extend(tools.problems(cfg.grpo.tools, cfg.grpo.environment))
    problems.extend(check_resume(cfg, cfg.parallel.nproc * nodes))
    ranks = rank_count_problem(cfg.parallel)
    if ranks:
        problems.append(ranks)
    hsdp = fsdp.hsdp_problem(cfg.parallel)
    if hsdp:
        problems.append(hsdp)
    return problems


def vllm_device_problems(cfg, path) -> list[str]:
    """What vLLM cannot run of the checkpoint at ``path`` (its experts' layout) or on this run's device (its CPU
    backend: a few head dims), where a key asks for vLLM; inside the engine it would fail only after the ranks
    started (:func:`qwenkit.model.families.vllm_limits.vllm_problem`)."""
    keys = [f"{k}=vllm" for k, v in (("grpo.rollout_engine", cfg.grpo.rollout_engine),
                                      ("train.eval_engine", cfg.train.eval_engine)) if v == "vllm"]  # fmt: skip
    if not keys:
        return []
    try:
        family = families.resolve(cfg.model.name, path)
    except ValueError:  # a checkpoint of no family, or of another: families.problems' to refuse
        return []
    why = vllm_problem(family, path, " and ".join(keys), cfg.model.dtype, resolve_device(cfg.parallel.device))
    return [why] if why else []


def vllm_server_problems(cfg, nodes: int) -> list[str]:
    """``vllm.mode: server``: a server the user started answers at ``vllm.server_url`` (retried for
    ``vllm.server_timeout_s``, TRL's ``check_server``); one the launcher starts has a node (one) and, on CUDA, a device
    the ranks do not use (:func:`qwenkit.engine.generation.vllm_server.server_devices`)."""
    v = cfg.vllm
    if v.mode != "server" or not vllm_rules.engines(cfg):
        return []
    if v.server_url:
        try:
            wait_up(v.server_url, v.server_timeout_s, "start it with `qwenkit vllm-serve --config <this run's config>`, "
                    "or leave vllm.server_url empty for the run to start its own")  # fmt: skip
        except (ServerGone, ServerRefused) as e:
            return [f"vllm.server_url={v.server_url!r}: {e}"]
        return []
    if nodes > 1:
        return [f"vllm.mode=server with vllm.server_url empty starts the server on this node, which the job's other "
                f"{nodes - 1} node(s) cannot be told of; start `qwenkit vllm-serve --host 0.0.0.0` and set vllm.server_url"]
    device = resolve_device(cfg.parallel.device)
    if device != "cpu" and device_count(device) <= cfg.parallel.nproc:
        return [f"vllm.mode=server starts its server on a {device} device the ranks do not use, but parallel.nproc="
                f"{cfg.parallel.nproc} ranks take all {device_count(device)}; use --nproc {device_count(device) - 1}, "
                "or set vllm.server_url to a server elsewhere"]  # fmt: skip
    return []


def check_extras(cfg) -> list[str]:
    """Optional extras this run needs that are not installed, one line each naming the pip extra
    (the ranks would fail only after the model is built, with a ``ModuleNotFoundError``).

    ``train.report_to: [mlflow]`` and ``model.fused_backend`` are refused by the config check
    already. The dataset is looked at only when ``datasets`` or PyAV is missing: its sources are
    opened (a Hugging Face dataset then fails, naming its extra), and without PyAV its rows are
    parsed for videos.
    """
    problems = []
    if cfg.lora.r > 0 and not qconfig.installed("peft"):
        problems.append(f"lora.r={cfg.lora.r} needs peft, which is not installed: pip install 'qwenkit[lora]'")
    if "tensorboard" in cfg.train.report_to and not qconfig.installed("tensorboard"):
        problems.append("train.report_to: tensorboard needs the tensorboard package, which is not installed: "
                        "pip install 'qwenkit[tensorboard]'")  # fmt: skip
    if cfg.data.path == "tiny" or (qconfig.installed("datasets") and qconfig.installed("av")):
        return problems
    paths = [cfg.data.path] + ([cfg.data.eval_path] if cfg.data.eval_path else [])
    prompts = qconfig.OBJECTIVES[cfg.train.objective].reads == "prompts"  # a GRPO prompt alone may hold a video
    for path in paths:
        try:
            sources = open_sources(path)
        except DataError as e:
            if "qwenkit[" in str(e):
                problems.append(str(e))
            continue  # any other problem of the data is the ranks' to report, row by row
        if qconfig.installed("av"):
            continue
        for source in sources:
            try:
                rows = len(source)
            except ValueError:  # a malformed file: the ranks report it
                continue
            if any(_has_videos(source, i, cfg.data.layout, prompts) for i in range(rows)):
                problems.append(f"data: {source.name} has video rows; reading them needs PyAV (FFmpeg bindings), "
                                "which is not installed: pip install 'qwenkit[video]'")  # fmt: skip
                break
    return problems


def check_prepared_rows(cfg, processor) -> str | None:
    """The bad-sample policy (``data.on_bad_sample``, ``data.max_bad_fraction``) on the training set and
    on ``data.eval_path`` when their index is cached already (:func:`qwenkit.data.load.cached_problem`): a
    file of the wrong layout (a DPO file given to GRPO, prompts alone given to SFT) is refused here, in
    one line, not in every rank. Nothing is read when the cache holds no index (the ranks scan, and say
    it), nor with ``data.fingerprint: content`` (its key hashes every data file): ``processor`` is then
    None (:func:`indexing_processor`)."""
    if processor is None:
        return None
    try:
        reads = qconfig.OBJECTIVES[cfg.train.objective].reads
        for source in (cfg.data.path, cfg.data.eval_path):
            if source not in (None, "tiny") and (problem := cached_problem(cfg.data, processor, reads, source)):
                return problem
    except (DataError, OSError):  # a dataset that does not open: the ranks report it, file by file
        return None
    return None


def indexing_processor(cfg):
    """The processor a cached index of this run's data is keyed by, when the cache may hold one; None
    when there is nothing to read, when finding it would hash every data file (``data.fingerprint:
    content``: the ranks' cost, not twice), or when it does not load (the ranks report that)."""
    folder = cache.cache_dir(cfg.data)
    if not folder.is_dir() or not any(folder.glob("*.npz")) or cfg.data.fingerprint == "content":
        return None
    try:
        return load_processor(cfg)
    except (DataError, OSError):
        return None


def check_data_size(cfg, world_size: int, processor=None) -> list[str]:
    """A training set that cannot fill one optimizer step on ``world_size`` ranks, and a ``data.eval_path``
    without rows: what every rank would fail on, by the ranks' own rule
    (:func:`qwenkit.data.pipeline.step_problem`, which :func:`qwenkit.data.pipeline.make_sampler` asks),
    refused here in one line. What is counted: the usable samples (pairs, prompts) when the dataset's index
    is cached (:func:`qwenkit.data.load.cached_samples`), else the rows of its JSON files, read no further
    than a step needs (:func:`qwenkit.data.load.rows_at_most`): every sample is a row, so fewer rows fail in
    any case; ``data.eval_fraction``'s held-out rows (:func:`qwenkit.data.split.held_out`) taken off. A
    dataset not counted here (a Hugging Face one, a file that does not parse) is the ranks' to check.
    ``processor``: :func:`indexing_processor`'s (None: no cached index is looked for)."""
    data, reads = cfg.data, qconfig.OBJECTIVES[cfg.train.objective].reads
    need, fraction = pipeline.step_samples(cfg, world_size), data.eval_fraction
    most = need
    while fraction and most - split.held_out(most, fraction) < need:  # the rows that leave `need` after the split
        most += 1
    problems = []
    for source, enough, held in ((data.path, most, False), (data.eval_path, 1, True)):
        if source is None:
            continue
        try:
            cached = load.cached_samples(data, processor, reads, source) if processor is not None else None
            count = cached if cached is not None else load.rows_at_most(data, enough, reads, source)
        except (DataError, OSError):  # a dataset that does not open: the ranks report it, file by file
            continue
        if count is None:
            continue
        named = f"data.path={source!r}" + (f" (data.tiny_samples={data.tiny_samples})" if source == "tiny" else "")
        has = f"has {count} usable {pipeline.UNITS[reads]}" if cached is not None else f"holds {count} row(s)"
        if held:
            if count == 0:
                problems.append(f"the eval set ({source}) has no usable rows: data.eval_path={source!r} {has}")
            continue
        if fraction:
            kept = max(count - split.held_out(count, fraction), 0)
            has += f", {kept} left to train on after data.eval_fraction={fraction:g}"
            count = kept
        if problem := pipeline.step_problem(cfg, count, world_size, f"{named} {has}"):
            problems.append(problem)
    return problems


def _has_videos(source, i: int, layout: str, prompts: bool) -> bool:
    try:
        return bool(parse_row(source.row(i), source.location(i), layout, prompts).videos)
    except ValueError:  # a bad row: data.on_bad_sample decides in the ranks
        return False


def check_module_paths(cfg) -> list[str]:
    """``parallel.shard_patterns``, ``parallel.recompute``, ``model.freeze``, the LoRA targets and
    saved modules and the ``train.param_groups`` patterns against the model's module tree, built
    on the meta device from the checkpoint's ``config.json``: no weights are read and no memory
    is taken (about a second for a 7B model), where the ranks would find the same mistake only
    after loading the weights, with ``config.yaml`` and ``logs/`` already written."""
    try:
        model = registry.build(dataclasses.replace(cfg.model, init_device="meta", freeze=[]))
    except (ValueError, OSError) as e:
        return [str(e)]
    problems = []
    for key in ("shard_patterns", "recompute"):  # auto: the family's units
        for pattern in families.units(model, key, getattr(cfg.parallel, key)):
            try:
                fsdp.match_modules(model, [pattern], f"parallel.{key}")  # the rule fully_shard and the recompute wrappers use
            except ValueError as e:
                problems.append(str(e))
    for path in cfg.model.freeze:
        try:
            registry.freeze(model, [path])  # the meta copy is thrown away: freezing it changes nothing
        except ValueError as e:
            problems.append(str(e))
    return problems + lora.problems(model, cfg.lora) + optim.group_problems(model, cfg.train)


def rank_count_problem(parallel) -> str | None:
    """More ranks than this node's accelerators fail in the ranks; more CPU ranks than cores swap
    the machine to a halt (each rank holds a model copy and its threads): refused before spawning."""
    try:
        device = resolve_device(parallel.device)
    except ValueError as e:
        return str(e)
    n, have = parallel.nproc, device_count(device)
    if device != "cpu" and n > have:
        return f"parallel.nproc={n} ranks on {device}, but this node sees {have} {device} device(s); use --nproc {have} or fewer"
    if device == "cpu" and n > have and not parallel.allow_oversubscribe:
        return (
            f"parallel.nproc={n} CPU ranks, but this process may use {have} core(s); use --nproc {have} or fewer, "
            "or set parallel.allow_oversubscribe=true to run them anyway"
        )
    return None


def check_resume(cfg, world_size: int | None = None) -> list[str]:
    """The resume rule (:func:`qwenkit.engine.checkpoints.resume.decide`) before any process starts: the
    checkpoint ``train.resume`` names exists, is whole (files and sizes as recorded; the ranks
    verify the checksums), fits this run of ``world_size`` ranks, and newer ones would not be
    written over. With ``resume: auto`` a damaged newest checkpoint is skipped, saying so."""
    try:
        decision = resume_rule.decide(cfg, world_size)
    except resume_rule.CheckpointError as e:
        return [str(e)]
    for _, problem in decision.skipped:
        print(f"qwenkit train: train.resume=auto: {problem}; resuming from {decision.path or 'scratch'} instead",
              file=sys.stderr)  # fmt: skip
    return []
