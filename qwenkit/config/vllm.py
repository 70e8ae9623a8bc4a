"""``vllm``: the vLLM engine of GRPO's rollouts (``grpo.rollout_engine: vllm``) and of evaluation
(``train.eval_engine: vllm``), and what it cannot go with (:mod:`qwenkit.engine.generation.vllm_engine`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ENGINES = ("hf", "vllm")  # grpo.rollout_engine, train.eval_engine, qwenkit eval --engine
Engine = Literal[ENGINES]
MODES = ("colocate", "server")  # vllm.mode: TRL's vllm_mode
SERVER_URL_ENV = "QWENKIT_VLLM_SERVER_URL"  # the ranks' copy of a server the launcher started (vllm.server_url empty)


@dataclass
class VllmConfig:
    """Where the engine runs, used where an ``*_engine`` key says vllm: one colocated engine per rank (TRL's
    colocate mode), or one server the ranks send requests and weights to (TRL's server mode)."""

    # colocate: a vLLM engine in every rank's process; server: one vLLM server process beside the ranks
    # (qwenkit.engine.generation.vllm_server), on devices they do not use; TRL's vllm_mode
    mode: Literal[MODES] = "colocate"
    # server mode: http://HOST:PORT of a server started by `qwenkit vllm-serve` (checked reachable before
    # the ranks start); empty: the launcher starts one on 127.0.0.1 and a free port; TRL's vllm_server_base_url
    server_url: str = ""
    # server mode: seconds to wait for the server to be up, and at most for any one of its replies or a
    # weight push, before one line says it stopped answering; TRL's vllm_server_timeout
    server_timeout_s: float = 240.0
    gpu_memory_utilization: float = 0.3  # CUDA: the device's share vLLM takes (TRL's vllm_gpu_memory_utilization)
    cpu_kv_cache_gib: float = 1.0  # CPU: VLLM_CPU_KVCACHE_SPACE when unset (else vLLM reserves 0.92 of the host)
    sleep: bool = True  # CUDA, colocate: release weights and KV cache between generations (sleep mode); CPU cannot
