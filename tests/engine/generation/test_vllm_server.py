"""vLLM's server mode (``vllm.mode: server``) against colocate (needs vLLM: make test-vllm).

One ``qwenkit vllm-serve`` for the module, on the tiny Qwen2.5-VL (float32), against a colocated engine in this
process built from the same config: the server's greedy replies, and a rollout's seeded samples with their
log-probs, equal colocate's (text, one- and two-image rows), before and after a push of other weights over the
weight channel. Through ``qwenkit train`` on 2 ranks, a GRPO run with the launcher's own server (rollouts and
evaluation on it): its server killed mid-run (by its reward) ends it in one line naming the URL, no hang; run again,
it resumes on a new server given the checkpoint's weights first, and every step's metrics are the uninterrupted
colocate run's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: make test-vllm runs these tests in .venv-vllm")

from conftest import assert_same_runs  # noqa: E402
from multiproc import free_port, scaled  # noqa: E402

from engine.generation.test_generate import write_mixed_eval_set  # noqa: E402
from qwenkit import config as qconfig  # noqa: E402
from qwenkit import data  # noqa: E402
from qwenkit.config.vllm import SERVER_URL_ENV  # noqa: E402
from qwenkit.engine.generation import generate as qgen  # noqa: E402
from qwenkit.engine.generation import vllm_client, vllm_engine, vllm_requests  # noqa: E402
from qwenkit.model.families import registry as families  # noqa: E402
from qwenkit.model.paths import load_processor  # noqa: E402
from qwenkit.model.tiny.checkpoint import ensure_checkpoint  # noqa: E402
from qwenkit.records import read_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ["data.max_length=2048", "data.tiny_samples=4", "train.eval_engine=vllm"]  # the engine both ends build
NEW_TOKENS = 10
HANG = 300  # seconds: a run waiting longer has hung
EXIT_RESUMABLE = 75  # train.stop_after: a checkpoint saved, run again to go on


KILL_ENV = "QK_KILL_THE_SERVER"  # "1": the run's first reward of its second rollout kills its server
CALLS = [0]  # this rank's reward calls


def es(prediction: str, reference: str, **row) -> float:
    """A reward the random tiny model can learn in a few steps: the share of ``e`` in the completion. With
    ``KILL_ENV`` set, rank 0's first call of the second rollout (its 2 prompts x 4 completions a rollout) first kills
    the run's server (the launcher's own: the one on ``SERVER_URL_ENV``'s port)."""
    CALLS[0] += 1
    port = os.environ.get(SERVER_URL_ENV, "").rsplit(":", 1)[-1]
    if os.environ.get(KILL_ENV) == "1" and os.environ.get("RANK") == "0" and CALLS[0] == 2 * 4 + 1:
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"vllm-serve" in argv and port.encode() in argv:
                os.kill(int(pid), signal.SIGKILL)
    return prediction.count("e") / max(1, len(prediction))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``qwenkit vllm-serve`` on the tiny model, on a free port: its URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, "-m", "qwenkit.cli", "vllm-serve", "--port", str(port), f"model.path={ensure_checkpoint()}", *ENGINE]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        vllm_client.wait_up(url, scaled(HANG), f"its log: {log}", alive=lambda: proc.poll() is None)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def engines(server, tmp_path_factory):
    """``(dataset, hf model, served engine, colocated engine)``, both engines from the same config."""
    path = ensure_checkpoint()
    cfg = qconfig.load(overrides=[f"model.path={path}", *ENGINE, "vllm.mode=server", f"vllm.server_url={server}"])
    processor = load_processor(cfg)
    dataset, _ = data.read_checked(cfg.data, processor, write_mixed_eval_set(tmp_path_factory.mktemp("rows")))
    served = vllm_engine.shared(vllm_engine.spec_of(cfg, processor, str(path)))
    local = vllm_engine.shared(vllm_engine.spec_of(vllm_engine.colocated(cfg), processor, str(path)))
    hf = families.of_directory(path).load("hf_class").from_pretrained(path, dtype=torch.float32).eval()
    return dataset, hf, served, local


def _rows(dataset) -> list[int]:
    """The rows vLLM takes of Qwen2.5-VL: all but its video's (vllm_requests)."""
    return [i for i in range(len(dataset)) if not dataset.index.videos(i)]


def _replies(engine, dataset) -> tuple[list, list, list]:
    """``(greedy ids, sampled ids, their log-probs)``: the eval path, and the rollouts' requests (seeded, log-probs,
    the image token banned)."""
    rows = _rows(dataset)
    greedy = [r.tokens for r in vllm_engine.generate_rows(engine, dataset, rows, qgen.Sampling(max_new_tokens=NEW_TOKENS))]
    asked = [vllm_requests.request(dataset, i)[0] for i in rows]
    banned = {dataset.processor.image_token_id: -100.0}
    params = [engine.params(temperature=1.0, seed=11 + i, max_tokens=NEW_TOKENS, logprobs=0, logit_bias=banned)
              for i in rows]  # fmt: skip
    samples = [out.outputs[0] for out in engine.generate(asked, params)]
    logps = [[step[t].logprob for step, t in zip(s.logprobs, s.token_ids)] for s in samples]
    return greedy, [list(s.token_ids) for s in samples], logps


def _equal(got, want) -> None:
    assert got[0] == want[0] and got[1] == want[1]
    for a, b in zip(got[2], want[2], strict=True):
        # the same engine code, weights, batch and CPU kernels on both ends: seen equal bit for bit; fp32 sums split
        # over other threads may move a log-prob near -log V = -6 by a few ulps (4.8e-7 each)
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=2e-6)


def test_the_server_replies_as_colocate(engines):
    dataset, hf, served, local = engines
    assert served.push(hf) == local.push(hf) == len(list(hf.parameters()))
    assert any(dataset.image_refs(i) for i in _rows(dataset))  # image rows cross the wire too
    _equal(_replies(served, dataset), _replies(local, dataset))


def test_after_a_push_the_server_replies_as_colocate_with_those_weights(engines):
    dataset, hf, served, local = engines
    before = _replies(served, dataset)
    other = type(hf)(hf.config).eval()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_(0, 0.2)
    try:
        assert served.push(other) == local.push(other)
        got = _replies(served, dataset)
        _equal(got, _replies(local, dataset))
        assert got[0] != before[0] and got[1] != before[1]  # the push carried the weights
    finally:
        served.push(hf)
        local.push(hf)


STEPS = 3  # the server dies in the second rollout; the third follows the resumed run's first push
URL = r"http://127\.0\.0\.1:\d+"
RUN = ["--config", str(ROOT / "params" / "tiny_cpu.yaml"), "train.objective=grpo", "data.tiny_samples=8",
       "data.tiny_eval_samples=4", "train.micro_batch_size=2", "train.lr=0.02", "train.warmup_steps=0",
       "train.max_grad_norm=0", "train.log_every=1", "grpo.num_generations=4", "grpo.max_new_tokens=8",
       "grpo.rollout_engine=vllm", "train.eval_engine=vllm", "train.eval_samples=4", "train.eval_max_new_tokens=8",
       f"train.steps={STEPS}", "checkpoint.every=1", "train.resume=auto", f"grpo.rewards=[{__name__}:es]"]  # fmt: skip


def _train(out, *overrides, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "qwenkit.cli", "train", *RUN, "--nproc", "2", "--master-port", str(free_port()),
           f"train.output_dir={out}", *overrides]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(HANG))


def _history(out) -> list[dict]:
    """Rank 0's logged metrics, one dict a step."""
    steps = defaultdict(dict)
    for row in read_jsonl(Path(out) / "metrics" / "rank-00000.jsonl"):
        if row["x_name"] == "step":
            steps[row["x"]][row["metric"]] = row["value"]
    return [steps[k] for k in sorted(steps)]


TIMING = ("step_time", "tokens_per_s", "samples_per_s", "peak_memory", "padding_fraction", "eval_generation_time",
          "rollout_time")  # fmt: skip


@pytest.fixture(scope="module")
def colocate(tmp_path_factory):
    """The GRPO run on 2 ranks, an engine in each (the reference): its folder."""
    out = tmp_path_factory.mktemp("colocate") / "run"
    done = _train(out, "vllm.mode=colocate")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _same_metrics(got_dir, want_dir) -> None:
    """Every step's metrics (rewards, loss, grad norm, entropy, the evals at 0 and the end) equal, timings aside;
    ``sampling/*`` (the trainer's log-probs against vLLM's, of each run's own samples) a few fp32 ulps in each."""
    runs = []
    for out in (got_dir, want_dir):
        steps = [{k: v for k, v in step.items() if k not in TIMING} for step in _history(out)]
        for step in steps[1:]:
            assert step.pop("sampling/sampling_logp_difference/max") < 1e-5, step
            assert step.pop("sampling/sampling_logp_difference/mean") < 1e-5, step
            for k in [k for k in step if k.startswith("sampling/importance_sampling_ratio/")]:
                assert step.pop(k) == pytest.approx(1, abs=1e-5), (k, step)
        runs.append(steps)
    got, want = runs
    assert len(want) == STEPS + 1 and "eval_accuracy" in want[0] and "eval_accuracy" in want[-1]  # evals at 0 and the end
    assert all(step["grad_norm"] > 0 for step in want[1:])  # every push after the first carried moved weights
    assert_same_runs(got, want)


def test_grpo_on_the_runs_own_server_equals_colocate_its_death_is_one_line_and_a_rerun_resumes_on_a_new_one(
    colocate, tmp_path
):  # fmt: skip
    """Two ranks and the launcher's server (rollouts and evaluation on it, the weights pushed by rank 0). Its server
    killed in the second rollout: the run ends non-zero in one line naming the URL and what to do (no traceback on
    the console, no hang). Run again: a new server, the checkpoint's weights pushed before its first rollout, and
    every step's metrics (the killed run's, then the resumed run's) are the uninterrupted colocate run's."""
    out = tmp_path / "run"
    killed = _train(out, "vllm.mode=server", env={KILL_ENV: "1"})
    assert killed.returncode not in (0, EXIT_RESUMABLE), killed.stderr[-3000:]
    said = [line for line in killed.stderr.splitlines() if "the vLLM server at http://127.0.0.1:" in line]
    assert len(said) == 1, killed.stderr[-3000:]
    assert "run the same command again to resume" in said[0] and "Traceback" not in killed.stderr, killed.stderr[-3000:]
    again = _train(out, "vllm.mode=server")
    assert again.returncode == 0, again.stderr[-3000:]
    urls = [re.search(URL, line)[0] for run in (killed, again) for line in run.stdout.splitlines() if "vLLM server at" in line]
    assert len(urls) == 2 and re.search(URL, said[0])[0] == urls[0], (urls, said)  # a server each; the first one died
    _same_metrics(out, colocate)
