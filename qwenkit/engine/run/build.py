"""Every model a run holds, built by one path: the policy the trainer trains, the frozen reference of
DPO and GRPO (full fine-tuning) and distillation's frozen teacher are the same build on the same meshes, so they compute alike and are
split alike (fused ops, expert parallelism, FSDP2 units, meta init).

1. :func:`fused_model`: the family's chunk-loss subclass (:func:`qwenkit.model.families.build.build`) with the
   run's fused ops where the family's entry says they fit (:func:`qwenkit.patches.apply`);
2. a frozen model: no gradients, its floating weights stored in ``parallel.param_dtype``
   (:func:`reference_model`); the policy: the caller's ``adapt`` (LoRA adapters, sequence parallelism,
   the parameter counts), all before anything is split;
3. ``parallel.ep_size > 1``: each rank keeps its whole experts and dispatches tokens to them
   (:func:`qwenkit.distributed.expert.apply`, on the run's expert mesh); the family's column-sharded tables
   (Qwen4-Exp's n-gram tables) keep each rank's columns, outside FSDP (:func:`qwenkit.distributed.columns.apply`);
4. recompute wrappers (the policy: a frozen model has no backward), ``fully_shard``
   (:func:`qwenkit.distributed.fsdp.shard`, the experts on their ``efsdp`` dimension);
5. ``model.init_device: meta``: storage, then the HF weights read into the shards (each rank its
   experts' rows), then the adapters' starting values.

The meshes (:class:`Meshes`) are made once per run (:func:`meshes`) and kept on the model
(``qwenkit_meshes``): a reference built later for the policy lands on the policy's meshes.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from qwenkit import patches
from qwenkit.config import DTYPES
from qwenkit.distributed import columns, expert, fsdp, sequence
from qwenkit.distributed.weights import load_adapters, load_hf_weights
from qwenkit.model import lora
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as family
from qwenkit.model.families.chunked import ChunkLossMixin

log = logging.getLogger(__name__)


def fused_model(cfg) -> ChunkLossMixin:
    """``registry.build(cfg.model, cfg.loss)``, then ``model.fused_backend``/``model.fused_ops``
    (the patch report is logged)."""
    model = registry.build(cfg.model, cfg.loss)
    patches.apply(model, backend=cfg.model.fused_backend, ops=cfg.model.fused_ops,
                  applicable=family.of_model(model).fused_ops)  # fmt: skip
    return model


@dataclass
class Meshes:
    """The run's device meshes: FSDP's (1-D, or HSDP's ``(replicate, shard)``), every rank's 1-D one of the
    column-sharded tables (FSDP's unless HSDP) and, with ``parallel.ep_size > 1``, the experts' ``(efsdp, ep)``
    (:func:`qwenkit.distributed.expert.build_expert_mesh`)."""

    fsdp: DeviceMesh
    tables: DeviceMesh
    experts: DeviceMesh | None = None


def meshes(cfg, rt) -> Meshes:
    """The run's meshes (collective: every rank makes the same process groups)."""
    ep = cfg.parallel.ep_size
    experts = expert.build_expert_mesh(rt.device.type, rt.world_size, ep) if ep > 1 else None
    mesh = fsdp.build_mesh(rt, cfg.parallel.hsdp_replicas)
    tables = mesh if mesh.ndim == 1 else init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("tables",))
    return Meshes(mesh, tables, experts)


def sharded_model(
    cfg, rt, on: Meshes, frozen: bool = False, adapt: Callable[[ChunkLossMixin], None] | None = None
) -> tuple[ChunkLossMixin, fsdp.ShardPlan]:
    """The module docstring's steps on the meshes ``on``; ``adapt(model)`` runs on the whole model
    before it is split (the policy's adapters and sequence parallelism). Returns the model and its plan."""
    model = fused_model(cfg)
    if frozen:
        _freeze(model, cfg.parallel.param_dtype)
    if adapt is not None:
        adapt(model)
    experts = None
    entry = family.of_model(model)
    if on.experts is not None:  # before recompute and fully_shard: each rank keeps its whole experts
        experts = expert.apply(model, entry.experts, on.experts)
    compute = DTYPES[cfg.parallel.param_dtype] if cfg.parallel.param_dtype else None
    tables = columns.apply(model, entry.column_sharded, on.tables, compute)  # each rank its columns, for good
    if tables and rt.rank == 0:
        held, whole = sum(p.to_local().nbytes for p in tables), sum(p.numel() * p.element_size() for p in tables)
        log.info("column-sharded tables: %d, %.1f MiB of their %.1f MiB on each rank (columns of every row)",
                 len(tables), held / 2**20, whole / 2**20)  # fmt: skip
    recomputed = [] if frozen else fsdp.apply_recompute(model, cfg.parallel.recompute)
    plan = fsdp.shard(model, cfg.parallel, on.fsdp, experts, ignored=tables)
    plan.recompute = recomputed
    if frozen:
        # fsdp.shard keeps the root gathered after forward, for the backward that follows it; a frozen
        # model has none, so its root (embeddings, tied lm_head) would stay whole on every rank for good
        model.set_reshard_after_forward(True, recurse=False)
    if cfg.model.init_device == "meta":
        fsdp.materialize(model, rt.device, cfg.parallel.cpu_offload)
        n = load_hf_weights(model, model.name_or_path)
        if lora.has_adapters(model):
            load_adapters(model, lora.initial_adapters(model, cfg.train.seed))
        if rt.rank == 0:
            log.info("meta init: %d tensors read into the shards from %s", n, model.name_or_path)
    model.qwenkit_meshes = on
    return model, plan


def _freeze(model: ChunkLossMixin, param_dtype: str | None) -> None:
    """No gradients; under mixed precision the floating weights stored in ``param_dtype``.

    FSDP2 casts every shard to ``param_dtype`` before each all-gather anyway, and a frozen model has
    no gradients or optimizer state that would want fp32 masters, so fp32 shards only double its
    memory (4 bytes a parameter instead of 2, summed over the ranks) and add a cast per all-gather.
    The gathered weights are the same bits (one round-to-nearest fp32 -> bf16 either way); buffers
    (rotary ``inv_freq``) are not FSDP's to cast and keep their dtype.
    """
    model.requires_grad_(False)
    if param_dtype:
        compute = DTYPES[param_dtype]
        for p in model.parameters():
            if p.is_floating_point() and p.element_size() > compute.itemsize:
                p.data = p.data.to(compute)


def reference_model(cfg, rt, policy: ChunkLossMixin) -> ChunkLossMixin:
    """The starting weights again, frozen, built and split as ``policy`` was (its meshes, its experts'
    ranks, its sequence-parallel group: its forwards on the same slices): the reference of full fine-tuning
    (DPO, GRPO with ``grpo.beta > 0``). Call it before a checkpoint is loaded into the policy. In eval mode;
    its vision calls per step are the policy's."""
    sp = policy.sequence_parallel
    ref, _ = sharded_model(cfg, rt, policy.qwenkit_meshes, frozen=True,
                           adapt=(lambda m: sequence.enable(m, sp)) if sp is not None else None)  # fmt: skip
    ref.vision_calls_per_step = policy.vision_calls_per_step
    return ref.eval()


def teacher_model(cfg, rt, policy: ChunkLossMixin, path: str) -> ChunkLossMixin:
    """Another checkpoint (``distill.teacher``'s HF directory) built, frozen and split as a reference is,
    on ``policy``'s meshes: the teacher of on-policy distillation. Its family is its own ``config.json``'s
    (``model.name: auto``); the student's model section gives the rest (dtype, attention, fused ops)."""
    model = dataclasses.replace(cfg.model, path=path, name="auto", freeze=[], init_from=None, init_recipe=None)
    teacher, _ = sharded_model(dataclasses.replace(cfg, model=model), rt, policy.qwenkit_meshes, frozen=True)
    teacher.vision_calls_per_step = policy.vision_calls_per_step
    return teacher.eval()
