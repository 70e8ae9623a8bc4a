"""vLLM as a generation engine: one colocated instance per rank, its weights pushed from the training model.

TRL's colocate mode: every rank runs its own ``vllm.LLM`` in its own process, built once
from the run's checkpoint directory (:func:`shared`: GRPO's rollouts and evaluation use the same one; with
``vllm.mode: server`` it hands out the server's client instead, :mod:`qwenkit.engine.generation.vllm_client`, whose
server runs this same engine, :mod:`qwenkit.engine.generation.vllm_server`)
and updated **in place** from the FSDP2-sharded policy before it samples (:meth:`VllmEngine.push`):

- **Weights.** Each parameter is gathered alone (``full_tensor()``, collective: every rank in the same
  order), under its HF name (the kit's subclasses keep HF's state-dict keys), and handed to vLLM's
  ``reload_weights`` as a checkpoint tensor, so vLLM's own name mapping and its CPU backend's repacking
  apply (TRL's ``_sync_fsdp2_params_to_vllm``, verl's ``get_per_tensor_param``). Its prefix, encoder
  and multimodal caches are cleared after (the encoder cache holds features of the old weights:
  EasyR1 clears it too). Fused MoE experts go out fused, in the family's published layout
  (:meth:`qwenkit.model.families.registry.Family.checkpoint_tensor`), and vLLM 0.32's reload is made to
  process them as its first load does (:func:`_reprocess_experts`: else its CPU experts kernel keeps
  unpacked weights); verl's per-expert names (PR #6896) answer another bug (vLLM #42821, CUDA) and would
  not reach this one. LoRA goes out merged (:mod:`qwenkit.engine.generation.push_tensors`: a linear's
  ``W + scaling * B @ A``, each expert's with ``lora.target_experts``; the adapters stay unmerged in the
  trained model); DoRA and ``lora.modules_to_save`` are refused before start (:mod:`qwenkit.config.vllm`).
- **Prompts** (:mod:`qwenkit.engine.generation.vllm_requests`): the kit's own prompt token ids (the
  dataset's template), each image, video and audio as one placeholder, the row's images, the kit's
  sampled video frames and its decoded audio waves as ``multi_modal_data``: vLLM expands the placeholders itself,
  and its expanded prompt is checked to be the kit's (:func:`~qwenkit.engine.generation.vllm_requests.check_prompts`).
- **An Omni thinker** starts from the whole model's directory the kit writes (vLLM names the Omni models by their
  whole checkpoints only), its pushed tensors named under ``thinker.`` (:mod:`qwenkit.engine.generation.vllm_omni`).
- **The process stays the kit's** (:func:`protected`): vLLM's CPU worker replaces
  ``torch.set_num_threads`` with a no-op, binds memory to a NUMA node, changes environment variables
  (``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``, ...) and reseeds the global RNGs; every call into vLLM runs inside
  :func:`protected`, which puts threads, affinity, memory policy, environment and RNG states back.
- **Its failures of a known cause** (out of memory, a KV cache too small, a model it cannot run:
  :func:`known_failure`) leave every call (:func:`engine_call`) as the kit's :class:`EngineFailure`, one line
  naming the ``vllm`` key to change; vLLM's traceback stays in the rank's log.
- **Memory.** CPU: ``VLLM_CPU_KVCACHE_SPACE`` (``vllm.cpu_kv_cache_gib``; without it vLLM reserves 0.92
  of the host). CUDA: ``vllm.gpu_memory_utilization`` of the device, and with ``vllm.sleep`` the engine
  sleeps (weights and KV cache released) between generations and wakes its weights before a push.
  ``sleep()`` does nothing on CPU.

vLLM is imported here only, inside :func:`start_engine` (the ``vllm`` extra, or ``vllm-cpu``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import platform
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from qwenkit.config.vllm import SERVER_URL_ENV
from qwenkit.engine.generation import vllm_patches
from qwenkit.engine.generation.generate import Generation, reply_text
from qwenkit.engine.generation.push_tensors import checkpoint_tensors
from qwenkit.engine.generation.vllm_client import ServedEngine
from qwenkit.engine.generation.vllm_omni import engine_dir
from qwenkit.engine.generation.vllm_requests import check_prompts, request
from qwenkit.errors import KnownCause
from qwenkit.model.families import registry as families
from qwenkit.model.families.vllm_limits import vllm_problem
from qwenkit.model.processor import Processor, pixel_bounds
from qwenkit.model.torchvision_ops import declare_missing_ops
from qwenkit.rundir import RunDir

SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}  # the set_mempolicy syscall's number per architecture
ENGINES: dict[EngineSpec, VllmEngine] = {}  # this process's engines, by what they were built from (:func:`shared`)
# a video's frames come sampled and resized by the kit (vllm_requests): vLLM's video processor keeps them as they are
VIDEOS_KWARGS = {"size": {"shortest_edge": 1, "longest_edge": 2**62}, "cap_pixels_per_frame": False}


@contextlib.contextmanager
def protected():
    """Run vLLM code with the process's threads, CPU affinity, memory policy, environment and RNGs
    put back afterwards (vLLM's CPU worker changes each of them, module docstring)."""
    env = dict(os.environ)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    states = (random.getstate(), np.random.get_state(), torch.random.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        os.environ.clear()
        os.environ.update(env)
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        _default_memory_policy()
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _default_memory_policy() -> None:
    """This thread's NUMA memory policy back to the default (vLLM's CPU worker binds it to one node)."""
    number = SET_MEMPOLICY.get(platform.machine())
    if sys.platform.startswith("linux") and number is not None:
        ctypes.CDLL(None, use_errno=True).syscall(number, 0, None, 0)  # MPOL_DEFAULT


class EngineFailure(KnownCause):
    """vLLM failed from a cause the kit knows (:func:`known_failure`): its message is the cause and the fix."""


_ONE_SEQUENCE = ("vLLM's KV cache cannot hold one sequence of data.max_length + the longer of grpo.max_new_tokens "
                 "and train.eval_max_new_tokens tokens",
                 "raise vllm.gpu_memory_utilization (CUDA) or vllm.cpu_kv_cache_gib (CPU), or lower data.max_length")  # fmt: skip
# what vLLM (0.8 to 0.11) says when it fails from a known cause: (words all in its message, the cause, the fix)
KNOWN_FAILURES = (
    (("no available memory for the cache blocks",), "vLLM has no memory left for its KV cache",
     "raise vllm.gpu_memory_utilization (CUDA) or vllm.cpu_kv_cache_gib (CPU), or lower what the trainer holds"),
    (("kv cache is needed, which is larger than the available kv cache memory",), *_ONE_SEQUENCE),  # vLLM >= 0.10
    (("larger than the maximum number of tokens that can be stored in kv cache",), *_ONE_SEQUENCE),  # before
    (("free memory on device", "less than desired gpu memory utilization"),
     "the device has less free memory than vllm.gpu_memory_utilization asks for, beside the trainer",
     "lower vllm.gpu_memory_utilization, or keep vllm.sleep=true"),
    (("are not supported for now",), "this vLLM cannot run the model's architecture",
     "use grpo.rollout_engine=hf and train.eval_engine=hf, or a vLLM that supports it"),
    (("failed to be inspected",), "vLLM could not inspect the model's architecture (its log names why)",
     "use grpo.rollout_engine=hf and train.eval_engine=hf, or a vLLM that supports it"),
)


def known_failure(error: BaseException) -> str | None:
    """``<cause> (vLLM: <its words>); <fix>`` when ``error``, raised inside vLLM, is a known one: out of
    device memory, a KV cache too small (:data:`KNOWN_FAILURES`), a model it cannot run. None otherwise
    (a bug of the kit's or of vLLM's: its traceback is worth seeing)."""
    said = " ".join(str(error).split())
    if isinstance(error, torch.OutOfMemoryError):
        return (f"vLLM ran out of device memory ({said[:200]}); lower vllm.gpu_memory_utilization, keep vllm.sleep=true, "
                "or lower train.micro_batch_size x grpo.num_generations (the sequences it holds at once)")  # fmt: skip
    for words, cause, fix in KNOWN_FAILURES:
        if all(w in said.lower() for w in words):
            return f"{cause} (vLLM: {said[:300]}); {fix}"
    return None


@contextlib.contextmanager
def engine_call():
    """A call into vLLM: :func:`protected`, and an error of a known cause (:func:`known_failure`) raised
    as the kit's :class:`EngineFailure`, whose one line says what to change (vLLM's traceback stays in the
    rank's log, as the error's cause)."""
    with protected():
        try:
            yield
        except Exception as e:  # noqa: BLE001 - vLLM raises ValueError, RuntimeError, torch's OutOfMemoryError...
            if (said := known_failure(e)) is not None:
                raise EngineFailure(said) from e
            raise


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is built from: the checkpoint directory, its dtype and the run's settings."""

    model_dir: str
    dtype: str  # model.dtype
    max_model_len: int  # prompt + completion tokens a sequence may hold
    seed: int
    min_pixels: int  # the processor's resize bounds, the run's data.min_pixels / max_pixels
    max_pixels: int
    gpu_memory_utilization: float
    cpu_kv_cache_gib: float
    sleep: bool  # CUDA: release weights and KV cache between generations
    mode: str = "colocate"  # vllm.mode: server, the engine is a server's (qwenkit.engine.generation.vllm_client)
    server_url: str = ""  # server mode: vllm.server_url, or the one the launcher started (SERVER_URL_ENV)
    server_timeout_s: float = 240.0
    server_note: str = ""  # server mode: what to do when it stops answering


class VllmEngine:
    """One ``vllm.LLM`` in this process (module docstring)."""

    def __init__(self, llm, spec: EngineSpec):
        self.llm, self.spec = llm, spec
        self.sleeps = spec.sleep and torch.cuda.is_available()  # sleep() does nothing on CPU
        self.asleep: set[str] = set()  # what sleep released: "weights", "kv_cache"

    def push(self, model: nn.Module) -> int:
        """The weights of ``model`` (FSDP2-sharded or plain) into the engine; collective over the ranks
        that shard it. Returns the number of tensors pushed."""
        return self.load(checkpoint_tensors(model, getattr(torch, self.spec.dtype)))

    def load(self, tensors) -> int:
        """``(name, tensor)`` pairs as the checkpoint holds them (:func:`~qwenkit.engine.generation.push_tensors.checkpoint_tensors`)
        into the engine, its caches cleared after; a server's push arrives here too. Returns how many came."""
        count = 0

        def counted():
            nonlocal count
            for item in tensors:
                count += 1
                yield item

        with engine_call():
            self._wake("weights")
            self.llm.collective_rpc(_reprocess_experts)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted(), "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()
            self.llm.llm_engine.reset_encoder_cache()
            self.llm.reset_mm_cache()
        return count

    def generate(self, requests: list[dict], params: list) -> list:
        """vLLM's ``RequestOutput`` of each request (:func:`request`), with its ``SamplingParams``."""
        with engine_call():
            self._wake("weights")
            self._wake("kv_cache")
            out = self.llm.generate(requests, params, use_tqdm=False)
            if self.sleeps:  # level 1: weights offloaded to host memory, KV cache dropped (TRL's colocate mode)
                self.llm.sleep(level=1)
                self.asleep = {"weights", "kv_cache"}
        return out

    @staticmethod
    def params(**settings):
        """vLLM's ``SamplingParams(**settings)``."""
        from vllm import SamplingParams  # loaded already: an engine exists

        return SamplingParams(**settings)

    def _wake(self, tag: str) -> None:
        if tag in self.asleep:
            self.llm.wake_up(tags=[tag])
            self.asleep.discard(tag)


def _reprocess_experts(worker) -> int:
    """In vLLM's worker (``collective_rpc``), before a reload: make the reload process each MoE layer's experts as
    the first load did; returns the number of layers. vLLM 0.32's reload (``reload_weights``: the layer's tensors
    restored on meta, the checkpoint tensors loaded into them, ``process_weights_after_loading``, the result
    copied into the live tensors) runs the unquantized experts' processing as a *weight update* once the layer
    has a kernel (``UnquantizedFusedMoEMethod._setup_kernel``: ``is_weight_update``), which skips the experts
    kernel's own ``process_weights_after_loading``. Where that is not a no-op (the CPU kernel: it zero-pads the
    intermediate dimension to 32 and prepacks both weights) the live tensors then get unpadded, unpacked
    weights: the copy fails (the tiny MoE's intermediate 16) or leaves wrong experts (bf16 Qwen3.5-MoE: weights
    0.12 off after reloading the checkpoint's own tensors). Without its kernel the layer is processed as at
    start: a new kernel, padded and prepacked, then copied into the same live storage."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    count = 0
    for module in worker.model_runner.model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
            continue
        process = type(method.moe_kernel.fused_experts).process_weights_after_loading
        if process is not FusedMoEExperts.process_weights_after_loading:  # CUDA's Triton kernel: nothing skipped
            method.moe_kernel = None
            count += 1
    return count


def start_engine(spec: EngineSpec) -> VllmEngine:
    """A new engine in this process (vLLM is imported here, the only place)."""
    with engine_call():
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: weights are pushed by a method call
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{spec.cpu_kv_cache_gib:g}")
        declared = declare_missing_ops()
        from vllm import LLM  # the vllm extra (CUDA) or vllm-cpu: imported only when an engine is asked for

        vllm_patches.apply()  # its Qwen2.5-VL positions after a video made the trainer's

        if declared:  # vLLM inspects model classes in a fresh interpreter: it needs the same declaration
            from vllm.model_executor.models import registry

            registry._SUBPROCESS_COMMAND = [sys.executable, "-c", _INSPECT]
        cuda = torch.cuda.is_available()
        model_dir, load_format = _engine_dir(spec.model_dir)
        llm = LLM(
            model=model_dir, load_format=load_format, dtype=spec.dtype, seed=spec.seed, max_model_len=spec.max_model_len,
            enforce_eager=not cuda, enable_sleep_mode=spec.sleep and cuda, logprobs_mode="processed_logprobs",  # after temperature, as the trainer's
            gpu_memory_utilization=spec.gpu_memory_utilization,
            mm_processor_kwargs={"size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
                                 "videos_kwargs": VIDEOS_KWARGS},
        )  # fmt: skip
    return VllmEngine(llm, spec)


def _engine_dir(model_dir: str) -> tuple[str, str]:
    """The directory and load format vLLM starts ``model_dir`` from (:func:`qwenkit.engine.generation.vllm_omni.engine_dir`:
    an Omni thinker's whole model)."""
    family = families.of_directory(model_dir)
    if family.whole is None:
        return model_dir, "auto"
    return engine_dir(family, Processor.from_pretrained(model_dir, family=family), model_dir)


# the registry's inspection command (vllm.model_executor.models.registry), torchvision's operators declared first
_INSPECT = ("from qwenkit.model.torchvision_ops import declare_missing_ops; declare_missing_ops(); import runpy; "
            "runpy.run_module('vllm.model_executor.models.registry', run_name='__main__')")  # fmt: skip


def shared(spec: EngineSpec) -> VllmEngine:
    """This process's engine for ``spec``, started (or, server mode, connected to) on first use (rollouts and
    evaluation share it)."""
    if spec not in ENGINES:
        ENGINES[spec] = ServedEngine(spec) if spec.mode == "server" else start_engine(spec)
    return ENGINES[spec]


def colocated(cfg):
    """``cfg`` with its engine colocated (``vllm.mode: colocate``): a server's own engine, and ``qwenkit eval``'s
    (it starts its own ranks; a training run's server is gone with the run)."""
    return dataclasses.replace(cfg, vllm=dataclasses.replace(cfg.vllm, mode="colocate", server_url=""))


def spec_of(cfg, processor, model_dir: str) -> EngineSpec:
    """The engine a run's config asks for (``vllm`` section, ``model.dtype``, the processor's pixel bounds):
    the same for GRPO's rollouts and evaluation, so they share it. A sequence holds ``data.max_length``
    tokens and the longest of the generation limits (an agentic trajectory's: ``grpo.max_trajectory_tokens``)."""
    family = processor.family
    if why := family.vllm_refusal:  # the launcher refused it already (Family.problems); qwenkit eval asks here
        raise ValueError(f"vLLM cannot run {family.name}: {why}; use the hf engine")
    if why := vllm_problem(family, model_dir, "the vllm engine", cfg.model.dtype, "cuda" if torch.cuda.is_available() else "cpu"):
        raise ValueError(why)  # the launcher and qwenkit eval refused it already, before any process started
    lo, hi = pixel_bounds(processor.image_processor)
    v = cfg.vllm
    longest = cfg.data.max_length + max(cfg.grpo.max_new_tokens, cfg.grpo.max_trajectory_tokens, cfg.train.eval_max_new_tokens)
    spec = EngineSpec(str(model_dir), cfg.model.dtype, longest, cfg.train.seed, lo, hi,
                      v.gpu_memory_utilization, v.cpu_kv_cache_gib, v.sleep)  # fmt: skip
    if v.mode != "server":
        return spec
    url = v.server_url or os.environ.get(SERVER_URL_ENV, "")
    if not url:
        raise ValueError("vllm.mode=server with vllm.server_url empty: the server is the launcher's to start "
                         "(qwenkit train); set vllm.server_url to a running `qwenkit vllm-serve`")  # fmt: skip
    if v.server_url:
        note = "restart it (`qwenkit vllm-serve --config ...` with this run's config), then run the same command again to resume"
    else:  # the launcher's own: a new run starts a new one
        note = (f"it was the run's own (its log: {RunDir(cfg.train.output_dir).logs / 'vllm-server.log'}); run the "
                "same command again to resume from the last checkpoint with a new server")  # fmt: skip
    return dataclasses.replace(spec, mode="server", server_url=url, server_timeout_s=v.server_timeout_s, server_note=note)


def generate_rows(engine: VllmEngine, dataset, indices: list[int], sampling, rank: int = 0) -> list:
    """:func:`qwenkit.engine.generation.generate.generate_rows` from ``engine``: replies to the prompts of
    ``dataset[indices]`` (greedy unless ``sampling.temperature`` > 0, then seeded by ``seed + rank`` and
    the row), ending at ``<|im_end|>`` or after ``max_new_tokens``, decoded as HF's are."""
    tok = dataset.processor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    asked = [request(dataset, i) for i in indices]
    how = {"temperature": sampling.temperature, "top_p": sampling.top_p} if sampling.temperature > 0 else {"temperature": 0.0}
    params = [engine.params(max_tokens=sampling.max_new_tokens, stop_token_ids=[end], seed=sampling.seed + rank + i, **how)
              for i in indices]  # fmt: skip
    outs = engine.generate([a[0] for a in asked], params)
    check_prompts(outs, asked)
    rows = []
    for i, (_, _, conv), out in zip(indices, asked, outs):
        new = list(out.outputs[0].token_ids)
        new = new[: new.index(end)] if end in new else new
        prompt = "\n".join(f"{role}: {text}" for role, text in conv.turns[:-1])
        images = [str(r.path) if r.path is not None else r.label for r in dataset.image_refs(i, conv)]
        rows.append(Generation(i, prompt, images, conv.reference, reply_text(tok, new), new))
    return rows


__all__ = ["EngineFailure", "EngineSpec", "colocated", "engine_call", "generate_rows", "known_failure", "VllmEngine", "protected",
           "shared", "spec_of", "start_engine"]  # fmt: skip
