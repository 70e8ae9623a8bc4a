"""A third-party engine's failure of a known cause (vLLM's KV cache too small, out of memory, a model it
cannot run) reaches the user as the kit's one line (``qwenkit train: rank N failed: <cause>; <fix>``),
the engine's traceback in the rank's log only (issue 66). No vLLM needed: a fake ``vllm`` package raises
what vLLM raises, in this process and under ``qwenkit train`` on 2 ranks (every rank, or one of them while
the other waits in a collective)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qwenkit.engine.generation import vllm_engine
from qwenkit.engine.run import rank
from qwenkit.errors import TRACEBACK_ENV

# what vLLM raises, word for word (vllm/v1/core/kv_cache_utils.py, vllm/worker/worker.py, its model registry)
VLLM_SAYS = {
    "no KV cache": (ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
                               "when initializing the engine."), "vllm.gpu_memory_utilization"),  # fmt: skip
    "one sequence too long": (ValueError(
        "To serve at least one request with the models's max seq len (8192), (0.38 GiB KV cache is needed, which is "
        "larger than the available KV cache memory (0.12 GiB). Based on the available memory, the estimated maximum "
        "model length is 2656. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
        "initializing the engine."), "data.max_length"),  # fmt: skip
    "max seq len, older vLLM": (ValueError(
        "The model's max seq len (8192) is larger than the maximum number of tokens that can be stored in KV cache "
        "(4096). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."),
        "vllm.cpu_kv_cache_gib"),  # fmt: skip
    "device busy": (ValueError("Free memory on device (6.92/79.1 GiB) on startup is less than desired GPU memory "
                               "utilization (0.3, 23.73 GiB). Decrease GPU memory utilization or reduce GPU memory "
                               "used by other processes."), "lower vllm.gpu_memory_utilization"),  # fmt: skip
    "out of memory": (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                             "capacity of 79.10 GiB of which 1.02 GiB is free."), "vllm.sleep=true"),  # fmt: skip
    "unsupported model": (ValueError("Model architectures ['Qwen9VLForConditionalGeneration'] are not supported for "
                                     "now. Supported architectures: dict_keys([...])"), "grpo.rollout_engine=hf"),  # fmt: skip
}
SPEC = vllm_engine.EngineSpec("/nowhere/model", "float32", 64, 0, 3136, 12845056, 0.3, 1.0, False)


def _fake_vllm(root, raises: str, ranks: str = "every") -> None:
    """A ``vllm`` package under ``root`` whose ``LLM(...)`` raises ``raises`` (Python source) on ``ranks``
    (``every``, or one rank's number); elsewhere an engine whose weight push reads every tensor."""
    package = root / "vllm"
    (package / "model_executor" / "models").mkdir(parents=True)
    (package / "model_executor" / "__init__.py").write_text("")
    (package / "model_executor" / "models" / "__init__.py").write_text("")
    (package / "model_executor" / "models" / "registry.py").write_text("_SUBPROCESS_COMMAND = None\n")
    (package / "__init__.py").write_text(textwrap.dedent(f"""
        import os

        class SamplingParams:
            def __init__(self, **settings):
                self.settings = settings

        class LLM:
            def __init__(self, **kwargs):
                if {ranks!r} in ("every", os.environ.get("RANK")):
                    raise {raises}

            def collective_rpc(self, method, timeout=None, args=(), kwargs=None):  # vLLM's signature
                for _ in (kwargs or {{}}).get("weights_iterator", ()):  # every tensor gathered: collective over the ranks
                    pass
    """))


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """Start :func:`qwenkit.engine.generation.vllm_engine.start_engine` on a fake vLLM raising ``error``."""

    def start(error: BaseException):
        class LLM:
            def __init__(self, **kwargs):
                raise error

        module = type(sys)("vllm")
        module.LLM = LLM
        monkeypatch.setitem(sys.modules, "vllm", module)
        return vllm_engine.start_engine(SPEC)

    return start


@pytest.mark.parametrize("case", VLLM_SAYS)
def test_a_known_vllm_failure_becomes_the_kits_cause_and_fix(case, fake_vllm):
    error, fix = VLLM_SAYS[case]
    with pytest.raises(vllm_engine.EngineFailure) as caught:
        fake_vllm(error)
    said = str(caught.value)
    assert fix in said and " ".join(str(error).split())[:60] in said, said  # the kit's words, then vLLM's own
    assert caught.value.__cause__ is error  # vLLM's traceback stays reachable: the rank's log shows it
    assert len(said.splitlines()) == 1


def test_an_unknown_vllm_failure_keeps_its_own_type_and_traceback(fake_vllm):
    error = RuntimeError("shape mismatch in a fused kernel")  # a bug, of vLLM's or the kit's: its traceback matters
    with pytest.raises(RuntimeError) as caught:
        fake_vllm(error)
    assert caught.value is error


def test_a_running_engines_out_of_memory_is_the_kits_one_line_too():
    class Llm:
        def generate(self, requests, params, use_tqdm):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB.")

    with pytest.raises(vllm_engine.EngineFailure, match=r"^vLLM ran out of device memory \(CUDA out of memory\. "):
        vllm_engine.VllmEngine(Llm(), SPEC).generate([{}], [None])


def test_the_rank_reports_it_in_one_line_and_logs_vllms_traceback(fake_vllm, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    try:
        fake_vllm(VLLM_SAYS["no KV cache"][0])
    except vllm_engine.EngineFailure as e:
        error = e
    log = tmp_path / "rank-00000.log"
    line = rank.report_failure(0, error, log)
    assert capsys.readouterr().err == f"{line}\n"
    assert line == f"qwenkit train: rank 0 failed: {error} (its traceback: {log})"
    assert line.startswith("qwenkit train: rank 0 failed: vLLM has no memory left for its KV cache (vLLM: No available ")
    assert "ValueError: No available memory for the cache blocks" in log.read_text()  # vLLM's own, in the log
    assert rank.report_failure(1, error, tmp_path / "rank-00001.log") and capsys.readouterr().err == ""  # rank 0 says it


@pytest.mark.slow
@pytest.mark.parametrize("ranks", ["every", "1"], ids=["every rank", "rank 1 alone"])
def test_qwenkit_train_says_a_vllm_failure_in_one_line(ranks, tmp_path):
    """GRPO with vLLM rollouts whose engine cannot start for want of KV cache: one line, exit 1, no traceback,
    whether every rank fails or rank 1 alone (rank 0 then loses its peer in the weight push's gather:
    it says nothing, rank 1's line is the one)."""
    from jobs import HANG, ROOT, train_cmd
    from multiproc import scaled

    from qwenkit.engine.run import events

    _fake_vllm(tmp_path, "ValueError('No available memory for the cache blocks. Try increasing "
                         "`gpu_memory_utilization` when initializing the engine.')", ranks)  # fmt: skip
    out = tmp_path / "run"
    cmd = train_cmd(out, "train.objective=grpo", "train.micro_batch_size=2", "grpo.num_generations=2",
                    "grpo.max_new_tokens=3", "grpo.rollout_engine=vllm", steps=2)  # the tiny default: vLLM's head dim  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(HANG))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("qwenkit train:") and "qwenkit.torchrun" not in line]
    failing = 0 if ranks == "every" else 1
    (line,) = ours
    assert line.startswith(f"qwenkit train: rank {failing} failed: vLLM has no memory left for its KV cache (vLLM: No "
                           "available memory for the cache blocks.") and "raise vllm.gpu_memory_utilization" in line, line
    log = out / "logs" / f"rank-0000{failing}.log"
    assert line.endswith(f"(its traceback: {log})") and "ValueError: No available memory" in log.read_text()
    failed = {e["rank"]: e for e in events.read(out) if e["event"] == "failed"}
    assert failed[failing]["error"] == "EngineFailure" and failed[failing]["input"]
