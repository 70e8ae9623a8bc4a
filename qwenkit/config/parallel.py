"""``parallel``: processes, backend and device, the FSDP2 shard plan, mixed precision, offload,
recompute, sequence and expert parallelism and the collective timeout."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from qwenkit.config.model import Dtype

# parallel.max_restarts at most: each restart resumes from the last checkpoint, so a group that failed
# this often fails for a reason a restart does not cure (and torchrun would retry it for ever)
MAX_RESTARTS = 100


@dataclass
class ParallelConfig:
    nproc: int = 1  # processes on this node (torchrun --nproc-per-node)
    allow_oversubscribe: bool = False  # CPU: allow more ranks than cores (each rank then gets a share of one)
    backend: Literal["auto", "gloo", "nccl", "hccl"] = "auto"
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    # the modules fully_shard wraps, one FSDP unit each; auto: the family's shard_units (qwenkit.model.families.registry.FAMILIES)
    shard_patterns: Literal["auto"] | list[str] = "auto"
    reshard_after_forward: bool = True
    param_dtype: Dtype | None = None  # FSDP2 MixedPrecisionPolicy; None keeps the weights' dtype
    reduce_dtype: Dtype | None = None
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: params, grads and optimizer state on host
    hsdp_replicas: int = 1  # >1: HSDP mesh (replicas, world // replicas); must divide the world size
    # modules recomputed in backward, e.g. [model.language_model.layers.*]; auto: the family's
    # recompute_units (qwenkit.model.families.registry.FAMILIES: the decoder layers); [] (default): none
    recompute: Literal["auto"] | list[str] = field(default_factory=list)
    activation_offload: bool = False  # saved activations to host memory
    # Ulysses sequence parallelism: groups of sp_size ranks split every sequence (1 = off);
    # data parallelism over nproc // sp_size groups. See docs/SEQUENCE_PARALLEL.md
    sp_size: int = 1
    # expert parallelism (MoE families): each layer's experts split whole across groups of ep_size
    # consecutive ranks, tokens sent to them; the experts FSDP-sharded over nproc // ep_size ranks.
    # 1 = off (experts sharded like any weight). See docs/TRAINING.md
    ep_size: int = 1
    # a collective (or the process group's start) waiting longer than this fails, naming the
    # rank that stopped answering; long enough for a 7B weight load or checkpoint save
    timeout_s: int = 600
    # torchrun's rendezvous (qwenkit/cluster.py, docs/CLUSTERS.md): static (each node told its rank),
    # c10d (torchrun's elastic one: --nnodes MIN:MAX, restarts), auto (c10d when the scheduler asks
    # for it, for a range of nodes or for restarts; else static)
    rendezvous: Literal["auto", "static", "c10d"] = "auto"
    rdzv_id: str = ""  # c10d across nodes: the job's id, the same on every node ("": Slurm's job id / the PyTorchJob's rdzvId)
    # c10d: times the whole group is restarted after a rank fails (0: the scheduler's, e.g. PET_MAX_RESTARTS);
    # each restart resumes from the newest complete checkpoint (set checkpoint.every to bound the lost steps); at most MAX_RESTARTS
    max_restarts: int = 0
