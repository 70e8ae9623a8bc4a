"""``vllm``: the vLLM engine of GRPO's rollouts (``grpo.rollout_engine: vllm``) and of evaluation
(``train.eval_engine: vllm``), and what it cannot go with (:mod:`qwenkit.engine.generation.vllm_engine`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ENGINES = ("hf", "vllm")  # grpo.rollout_engine, train.eval_engine, qwenkit eval --engine
Engine = Literal[ENGINES]


@dataclass
class VllmConfig:
    """One colocated vLLM engine per rank (TRL's colocate mode), used where an ``*_engine`` key says vllm."""

    gpu_memory_utilization: float = 0.3  # CUDA: the device's share vLLM takes (TRL's vllm_gpu_memory_utilization)
    cpu_kv_cache_gib: float = 1.0  # CPU: VLLM_CPU_KVCACHE_SPACE when unset (else vLLM reserves 0.92 of the host)
    sleep: bool = True  # CUDA: release weights and KV cache between generations (sleep mode); CPU cannot
