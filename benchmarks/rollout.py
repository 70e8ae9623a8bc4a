"""GRPO's rollout on its three engines: hf (the kit's HfRollouts) vs vLLM colocate vs a vLLM server.

Run with ``.venv-vllm``'s python. The same rollout on each engine: ``--prompts`` text prompts of random
ordinary ids x ``--generations`` completions of ``new`` tokens each, sampled at temperature 1, every
completion seeded (:func:`~qwenkit.engine.rollouts.completion.completion_seed`); every completion runs to its
full length (hf: the end token suppressed, as ``benchmarks/dpo_grpo_step.py``; vLLM: ``ignore_eos``), and the
benchmark fails unless every engine generated the same number of tokens. The policy is the kit's training
model (``QwenkitQwen2_5_VL``, chunked head), FSDP2-sharded in a one-rank gloo group, as a GRPO rank holds it:

- ``hf``: ``HfRollouts`` (weights gathered once, one batched ``generate`` of every completion);
- ``colocate``: the rank's own ``vllm.LLM`` (``vllm.mode: colocate``,
  :mod:`qwenkit.engine.generation.vllm_engine`), the policy's weights pushed before each rollout;
- ``server``: ``qwenkit vllm-serve`` started by the kit (:func:`qwenkit.engine.generation.vllm_server.start`,
  ``vllm.mode: server``), the weights pushed over its gloo channel before each rollout.

A rollout's seconds are the push and the generation (as the trainer's ``rollout_time``), the best of
``--repeats`` after an untimed first push and short generation (``WARMUP`` tokens of one completion); tokens/s = generated tokens / those seconds. Its share of a GRPO step: the rollout over the
rollout plus the learner's forward/backward/AdamW on the same completions (``completions / 2`` micro-batches
of one group of 2, :func:`benchmarks.dpo_grpo_step.grpo_step`, ``grpo.beta``'s default: a frozen reference
copy), timed in its own process. Peak memory: the peak RSS of the worker process (policy, optimizer-free
rollout, the colocated engine and its KV cache), plus the server's own peak RSS in server mode. Each engine
runs in a fresh process (:func:`qwenkit.bench.measure.fresh_process`).

Shapes (random weights): ``tiny`` (the embedded default tiny Qwen2.5-VL: heads of 32, vLLM's CPU attention
runs it as it is) and ``0.5b`` (Qwen2.5-0.5B's text stack in the tiny Qwen2.5-VL: hidden 896, 24 layers,
14 heads / 2 kv heads of 64, intermediate 4864, vocabulary 151,936 tied; the tiny vision tower). ``--seq``:
prompt + completion, half each.

    python benchmarks/rollout.py --quick                      # the tiny model, S=128: a smoke check
    python benchmarks/rollout.py --out benchmarks/results/rollout_cpu.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.* when run as a script

from benchmarks.timing import GiB, timed_steps  # noqa: E402
from qwenkit.bench.measure import fresh_process  # noqa: E402
from qwenkit.device import memory_bytes  # noqa: E402

ENGINES = ("hf", "colocate", "server")
SHAPES = ("tiny", "0.5b")
WARMUP = 8  # new tokens of each engine's untimed first generation (vLLM's first one allocates and warms up)
HALF_B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151_936, max_position_embeddings=32_768)  # Qwen2.5-0.5B  # fmt: skip


def half_b(config):
    """The tiny Qwen2.5-VL's config with Qwen2.5-0.5B's text sizes (mRoPE of head dim 64), in place."""
    text = config.text_config
    for k, v in HALF_B.items():
        setattr(text, k, v)
    text.head_dim = 64
    if getattr(text, "layer_types", None):
        text.layer_types = [text.layer_types[0]] * text.num_hidden_layers
    if getattr(text, "max_window_layers", None):
        text.max_window_layers = text.num_hidden_layers
    for rope in ("rope_parameters", "rope_scaling"):
        if isinstance(getattr(text, rope, None), dict) and "mrope_section" in getattr(text, rope):
            getattr(text, rope)["mrope_section"] = [8, 12, 12]
    config.vision_config.out_hidden_size = HALF_B["hidden_size"]
    config.vocab_size = HALF_B["vocab_size"]
    return config


def checkpoint(shape: str) -> Path:
    """The checkpoint directory of ``shape`` (written once, in the tiny models' cache)."""
    from qwenkit.model.tiny import checkpoint as tiny

    if shape == "tiny":
        return tiny.ensure_checkpoint()
    return tiny.ensure_checkpoint(tie_word_embeddings=True, reshape=tiny.Reshape("rollbench-0.5b", 1, half_b))


def server_peak(pid: int) -> int:
    """Peak resident bytes of the server process ``pid`` (Linux ``VmHWM``; this process's own:
    :func:`qwenkit.device.memory_bytes`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def prompts(args, vocab_ordinary: int):
    """``--prompts`` prompts of ``prompt`` random ids (seeded), each as ``[1, P]`` inputs."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.prompts):
        ids = torch.randint(0, vocab_ordinary, (1, args.prompt), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": torch.zeros_like(ids)})
    return out


def policy(path: Path, shard: bool = True):
    """The training model of ``path``'s weights, FSDP2-sharded in a one-rank gloo group (a GRPO rank's; the
    learner's is not: its reference is a copy, as dpo_grpo_step.py's learner variants)."""
    import torch
    import torch.distributed as dist

    from qwenkit import config as qconfig
    from qwenkit.distributed import fsdp
    from qwenkit.model.families.qwen2_5_vl import QwenkitQwen2_5_VL

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = QwenkitQwen2_5_VL.from_pretrained(path, dtype=torch.float32).configure_loss(chunk=True, chunk_size="auto")
    if not shard:
        return model
    runtime = fsdp.Runtime(0, 1, 0, torch.device("cpu"), "gloo", False)
    fsdp.shard(model, qconfig.load().parallel, fsdp.build_mesh(runtime))
    return model


def run_config(args, path: Path, out: Path, mode: str):
    from qwenkit import config as qconfig

    return qconfig.load(overrides=[f"model.path={path}", "model.dtype=float32", f"data.max_length={args.prompt}",
                                   "train.objective=grpo", f"grpo.max_new_tokens={args.new}", "grpo.rollout_engine=vllm",
                                   f"grpo.num_generations={args.generations}", f"vllm.mode={mode}",
                                   f"vllm.cpu_kv_cache_gib={args.kv_cache_gib}", f"train.output_dir={out}"])  # fmt: skip


def worker(args) -> dict:
    """One engine's rollouts (module docstring), or the learner's step (``--engine learner``)."""
    from qwenkit.engine.rollouts.completion import completion_seed

    path = checkpoint(args.shape)
    model = policy(path, shard=args.engine != "learner")
    rows = prompts(args, min(model.config.image_token_id, model.config.vision_start_token_id))
    if args.engine == "learner":
        return learner(args, model, rows)
    keys = [(k, g) for k in range(args.prompts) for g in range(args.generations)]
    seeds = [completion_seed(0, 0, k, g) for k, g in keys]
    server, served = None, 0  # served: the server's peak RSS (server mode)
    times, pushes = [], []
    if args.engine == "hf":
        from qwenkit.engine.generation.sampling import Sampling
        from qwenkit.engine.rollouts.hf import HfRollouts

        rollouts = HfRollouts(Sampling(args.new, temperature=1.0), args.generations, where="gather")
        end = 0  # suppressed: every completion runs to its full length
        rollouts.sample_rows(model, [rows[0]], seeds[:1], end, end, [end], max_new_tokens=WARMUP)  # untimed
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tokens = rollouts.sample_rows(model, [rows[k] for k, _ in keys], seeds, end, end, [end])
            times.append(time.perf_counter() - t0)
            pushes.append(0.0)
    else:
        from qwenkit.config.vllm import SERVER_URL_ENV
        from qwenkit.engine.generation import vllm_engine, vllm_server
        from qwenkit.launch import free_port
        from qwenkit.model.paths import load_processor

        tmp = Path(tempfile.mkdtemp(prefix="rollbench-"))
        cfg = run_config(args, path, tmp / "run", args.engine)
        if args.engine == "server":
            from qwenkit.config import write_config

            server = vllm_server.start(cfg, write_config(cfg, tmp), dict(os.environ), free_port())
            os.environ[SERVER_URL_ENV] = server.url
        try:
            engine = vllm_engine.shared(vllm_engine.spec_of(cfg, load_processor(cfg), str(path)))
            requests = [{"prompt_token_ids": rows[k]["input_ids"][0].tolist()} for k, _ in keys]
            params = [engine.params(n=1, temperature=1.0, max_tokens=args.new, ignore_eos=True, seed=s, logprobs=0)
                      for s in seeds]  # fmt: skip
            warm = engine.params(n=1, temperature=1.0, max_tokens=WARMUP, ignore_eos=True, seed=0)
            engine.push(model)
            engine.generate(requests[:1], [warm])  # untimed: the engine's first generation
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                engine.push(model)
                t1 = time.perf_counter()
                outs = engine.generate(requests, params)
                times.append(time.perf_counter() - t0)
                pushes.append(t1 - t0)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            served = server_peak(server.process.pid) if server else 0
        finally:
            if server:
                server.stop()
    best = min(range(len(times)), key=times.__getitem__)
    return {"shape": args.shape, "engine": args.engine, "prompts": args.prompts, "generations": args.generations,
            "prompt": args.prompt, "new": args.new, "completions": len(keys), "tokens": sum(map(len, tokens)),
            "lengths": sorted({len(t) for t in tokens}), "rollout_s": times[best], "push_s": pushes[best],
            "all_rollout_s": times, "peak_bytes": memory_bytes("cpu") + served,
            "server_peak_bytes": served}  # fmt: skip


def learner(args, model, rows) -> dict:
    """The GRPO learner's step on the rollout's completions: ``completions / 2`` micro-batches of 2 rows of
    prompt + ``new`` tokens (dpo_grpo_step's ``grpo_step``), the median of ``--repeats`` steps after one warm-up."""
    import copy
    import functools

    import torch

    from benchmarks.dpo_grpo_step import grpo_step
    from qwenkit.config import GrpoConfig
    from qwenkit.model.losses.cross_entropy import IGNORE_INDEX

    g = torch.Generator().manual_seed(1)
    ids = torch.cat([rows[0]["input_ids"].repeat(2, 1), torch.randint(0, rows[0]["input_ids"].max().item() + 1,
                                                                      (2, args.new), generator=g)], dim=1)  # fmt: skip
    labels = ids.clone()
    labels[:, : args.prompt] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
             "mm_token_type_ids": torch.zeros_like(ids)}  # fmt: skip
    beta = GrpoConfig().beta
    model.train()
    reference = copy.deepcopy(model).requires_grad_(False).eval() if beta > 0 else None

    def logps(m):
        return lambda b: m.token_logps(**b)[0]

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, fused=True)
    step = functools.partial(grpo_step, beta=beta)
    step_s, _ = timed_steps(lambda: step(logps(model), logps(reference) if reference else None, batch), opt,
                            torch.device("cpu"), 1, args.repeats)  # fmt: skip
    micro = args.prompts * args.generations // 2
    return {"shape": args.shape, "engine": "learner", "micro_step_s": step_s, "micro_batches": micro,
            "step_s": micro * step_s, "peak_bytes": memory_bytes("cpu"), "beta": beta}  # fmt: skip


def sizes(args, shape: str, seq: int) -> dict:
    """Prompts, generations and lengths of a (shape, S) case: fewer completions where they cost more."""
    if args.quick:
        return {"prompts": 1, "generations": 2, "prompt": seq // 2, "new": seq // 2}
    few = shape == "0.5b" or seq > 1024
    return {"prompts": 1 if few else 2, "generations": 2 if shape == "0.5b" else 4, "prompt": seq // 2, "new": seq // 2}


def run(args) -> int:
    results, failed = [], False
    for shape in args.shapes:
        for seq in args.seq:
            case = sizes(args, shape, seq)
            common = ["--shape", shape, "--repeats", str(args.repeats), "--kv-cache-gib", str(args.kv_cache_gib),
                      *[x for k, v in case.items() for x in (f"--{k}", str(v))]]  # fmt: skip
            rows = [fresh_process([__file__, "--worker", "--engine", e, *common], f"{shape} S={seq} {e}")
                    for e in [*args.engines, "learner"]]  # fmt: skip
            learn = rows.pop()
            failed |= table(shape, seq, case, rows, learn, args.repeats)
            results += rows + [learn]
    if args.out:
        from qwenkit.notebooks.results import write_jsonl

        load = os.getloadavg()
        write_jsonl([{**r, "date": time.strftime("%Y-%m-%d"), "load_avg": load} for r in results], args.out)
    return 1 if failed else 0


def table(shape: str, seq: int, case: dict, rows: list[dict], learn: dict, repeats: int) -> bool:
    """The case's table; True when the engines' token counts differ."""
    base = next((r for r in rows if r["engine"] == "hf"), rows[0])
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{shape} S={seq}: {case['prompts']} prompt(s) x {case['generations']} completions, prompt {case['prompt']} "
          f"+ new {case['new']}; best of {repeats}; learner step {learn['step_s']:.2f} s ({learn['micro_batches']} "
          f"micro-batches of 2, peak {learn['peak_bytes'] / GiB:.2f} GiB); load average {load}")  # fmt: skip
    print(f"{'engine':<10}{'tokens':>8}{'s':>9}{'push s':>8}{'tok/s':>9}{'x hf':>7}{'share':>7}{'peak GiB':>10}"
          f"{'server GiB':>11}{'mem x hf':>9}")  # fmt: skip
    for r in rows:
        r["tokens_per_s"] = r["tokens"] / r["rollout_s"]
        r["speedup"] = r["tokens_per_s"] / (base["tokens"] / base["rollout_s"])
        r["share"] = r["rollout_s"] / (r["rollout_s"] + learn["step_s"])
        r["mem_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        r["seq"] = seq
        print(f"{r['engine']:<10}{r['tokens']:>8}{r['rollout_s']:>9.2f}{r['push_s']:>8.2f}{r['tokens_per_s']:>9.1f}"
              f"{r['speedup']:>7.2f}{r['share']:>7.0%}{r['peak_bytes'] / GiB:>10.2f}"
              f"{r['server_peak_bytes'] / GiB:>11.2f}{r['mem_ratio']:>9.2f}")  # fmt: skip
    learn["seq"] = seq
    want = case["prompts"] * case["generations"] * case["new"]
    bad = [r["engine"] for r in rows if r["tokens"] != want or r["lengths"] != [case["new"]]]
    if bad:
        print(f"token counts differ from {want} ({case['new']} a completion): {', '.join(bad)}", file=sys.stderr)
    return bool(bad)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    p.add_argument("--seq", type=int, nargs="+", default=[512, 2048], help="prompt + completion tokens (half each)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--repeats", type=int, default=2, help="rollouts per engine (the best is reported)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="vllm.cpu_kv_cache_gib (its default)")
    p.add_argument("--quick", action="store_true", help="the tiny model at S=128, 1 prompt x 2: a smoke check")
    p.add_argument("--out", default=None, help="also write the results as JSON lines here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    for k in ("prompts", "generations", "prompt", "new"):
        p.add_argument(f"--{k}", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if args.quick:
        args.shapes, args.seq, args.repeats = ["tiny"], [128], 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
