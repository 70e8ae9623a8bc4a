"""Held-out generation throughput: today's path vs batched on one rank vs sharded over 2 ranks.

32 held-out rows of the tiny synthetic set (one image each, a third of them two-turn: prompts of
different lengths), greedy replies of ``--new-tokens`` tokens from the embedded tiny Qwen2.5-VL
(fp32; random weights by default, so every row runs to the token limit: no row finishes early and
the one-row path does the same decoding steps as the batched ones, or ``--checkpoint`` a run's
output_dir or checkpoint, where replies end at ``<|im_end|>``):

- ``one row, 1 rank``: the path before sharded generation: one process (rank 0) generates every
  row, one ``generate`` call each, while the other ranks wait;
- ``batched, 1 rank``: the same process, ``--batch-size`` prompts per call, left-padded;
- ``sharded batched, 2 ranks``: two gloo ranks, each its half of the rows in batches from its
  own full copy (``train.eval_generation=gather``), the rows gathered to rank 0 in row order
  (:func:`qwenkit.engine.generation.evaluate.generate_and_score`);
- ``lockstep batched, 2 ranks``: the same two ranks stepping the FSDP2-sharded training model
  together (``train.eval_generation=lockstep``): every forward all-gathers the weights.

Rows per second from the first prompt to the last reply (on 2 ranks: barrier to gather, the
slower rank), the best of ``--repeats``. Every process is one rank and gets one rank's share of
the cores (``--threads-per-rank``, default half of them), as every rank owns its accelerator:
the one-process variants leave the second rank's share idle, as rank 0 generating alone did.
The replies must be equal token for token across the variants, else the benchmark fails.

``--run RUN``: the acceptance figure instead. For every accuracy evaluation of a training run
that has a checkpoint of its step, the generation time the run logged (``eval_generation_time``
in its metrics: generation, scores and the rows' gather, the slower rank) against today's path
on the same weights and rows (one process, one row per call, ``--threads-per-rank`` threads),
the replies compared with the run's ``eval/step-*.jsonl`` token for token. The gather of the
full copy is left out of both: today's path gathered the same copy (to rank 0).

    python benchmarks/generation.py                       # the table; --out writes JSON lines
    python benchmarks/generation.py --run runs/tiny_cpu   # a run's generation time vs the one-row path
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwenkit import config as qconfig
from qwenkit import data as qdata
from qwenkit.distributed import fsdp
from qwenkit.distributed.meta import build_on_meta
from qwenkit.engine.generation import eval_command, evaluate
from qwenkit.engine.generation import generate as qgen
from qwenkit.engine.run import metrics
from qwenkit.launch import free_port
from qwenkit.model.families import registry as families
from qwenkit.model.paths import load_processor


def load(args):
    """``(model, dataset)``: the tiny model (seeded random weights) or ``--checkpoint``'s, and 32 held-out rows."""
    if args.checkpoint:
        model, processor, cfg, _ = eval_command.load_for_eval(args.checkpoint)
    else:
        from transformers import Qwen2_5_VLForConditionalGeneration

        from qwenkit.model.paths import resolve_path

        cfg = qconfig.load(overrides=["model.path=tiny"])
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(resolve_path(cfg.model))
        torch.manual_seed(args.seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.05)
        processor = load_processor(cfg)
    cfg = qconfig.load(overrides=["data.path=tiny", f"data.tiny_eval_samples={args.rows}", "data.tiny_samples=16"])
    dataset = qdata.build(cfg, processor).eval_dataset
    return model.eval(), dataset


def training_model(model, world_size: int):
    """``model``'s weights in the family's qwenkit subclass (chunk loss on, as training holds it),
    FSDP2-sharded over the ``world_size`` gloo ranks with the default shard plan."""
    rank = dist.get_rank()
    sharded = build_on_meta(families.of_model(model).load("subclass"), model.config)
    sharded.load_state_dict(model.state_dict(), strict=True, assign=True)
    sharded.configure_loss(chunk=True)
    sharded.vision_calls_per_step = 1
    runtime = fsdp.Runtime(rank, world_size, rank, torch.device("cpu"), "gloo", False)
    fsdp.shard(sharded, qconfig.load().parallel, fsdp.build_mesh(runtime))
    return sharded


def timed(model, dataset, sampling, repeats, rank=0, world_size=1, out=None, lockstep=False) -> tuple[float, list[list[int]] | None]:
    """The best of ``repeats`` timings of generating every row, and the replies' tokens (rank 0)."""
    out = out or Path(tempfile.mkdtemp()) / "rows.jsonl"
    best = float("inf")
    for _ in range(repeats):
        if world_size > 1:
            dist.barrier()
        t0 = time.perf_counter()
        evaluate.generate_and_score(model, dataset, list(range(len(dataset))), sampling, ["exact"], rank, world_size, out,
                                    lockstep=lockstep)  # fmt: skip
        seconds = time.perf_counter() - t0
        if world_size > 1:  # the slower rank's time: rank 0 has every row only once both are done
            box = torch.tensor([seconds])
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            seconds = box.item()
        best = min(best, seconds)
    return best, [r["tokens"] for r in qgen.read_jsonl(out)] if rank == 0 else None


def _rank(rank, world, port, args, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads_per_rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, dataset = load(args)
    sampling = qgen.Sampling(args.new_tokens, batch_size=args.batch_size)
    got = {}
    for name, source, lockstep in (("copy", model, False), ("lockstep", training_model(model, world), True)):
        seconds, tokens = timed(source, dataset, sampling, args.repeats, rank, world,
                                Path(result).with_suffix(f".{name}.jsonl"), lockstep)  # fmt: skip
        got[name] = {"seconds": seconds, "tokens": tokens}
    if rank == 0:
        torch.save(got, result)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32, help="held-out rows")
    p.add_argument("--new-tokens", type=int, default=8, help="max_new_tokens (tiny_cpu's eval_max_new_tokens)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (train.eval_batch_size)")
    p.add_argument("--checkpoint", default=None, help="a run's output_dir or checkpoint (default: random tiny weights)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads-per-rank", type=int, default=max(1, torch.get_num_threads() // 2), help="torch threads of each process")
    p.add_argument("--repeats", type=int, default=2, help="timings per variant; the best is reported")
    p.add_argument("--out", default=None, help="also write the results as JSON lines here")
    p.add_argument("--run", default=None, help="a training run's output_dir: its generation time vs the one-row path")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads_per_rank)
    if args.run:
        return against_the_run(Path(args.run), args)
    model, dataset = load(args)
    results = []
    for name, batch in (("one row, 1 rank", 1), (f"batched ({args.batch_size}), 1 rank", args.batch_size)):
        seconds, tokens = timed(model, dataset, qgen.Sampling(args.new_tokens, batch_size=batch), args.repeats)
        results.append({"variant": name, "ranks": 1, "batch_size": batch, "seconds": seconds, "tokens": tokens})
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "sharded.pt")
        mp.start_processes(_rank, args=(2, free_port(), args, result), nprocs=2, start_method="spawn")
        got = torch.load(result)
    for name, variant in (("copy", "sharded batched"), ("lockstep", "lockstep batched")):
        results.append({"variant": f"{variant} ({args.batch_size}), 2 ranks", "ranks": 2, "batch_size": args.batch_size,
                        **got[name]})  # fmt: skip

    base = results[0]
    print(f"{len(dataset)} held-out rows, {args.new_tokens} new tokens, tiny Qwen2.5-VL fp32 CPU, "
          f"{args.threads_per_rank} thread(s) per rank, best of {args.repeats}")
    print(f"{'variant':<34} {'seconds':>8} {'rows/s':>8} {'speedup':>8}  replies equal")
    for r in results:
        r["rows_per_s"] = len(dataset) / r["seconds"]
        r["speedup"] = base["seconds"] / r["seconds"]
        r["equal"] = r["tokens"] == base["tokens"]
        print(f"{r['variant']:<34} {r['seconds']:>8.2f} {r['rows_per_s']:>8.2f} {r['speedup']:>7.2f}x  {r['equal']}")
    if args.out:
        from qwenkit.notebooks.results import write_jsonl

        write_jsonl([{k: v for k, v in r.items() if k != "tokens"} for r in results], args.out)
    if not all(r["equal"] for r in results):
        print("replies differ between the variants", file=sys.stderr)
        return 1
    return 0


def against_the_run(run: Path, args) -> int:
    """The run's logged generation time per accuracy evaluation vs today's path on its checkpoint."""
    from qwenkit.engine.checkpoints import folder as checkpoint_dir

    rows = metrics.read(run)
    ranks = sorted({r["rank"] for r in rows})
    logged = {step: max(metrics.series(rows, "eval_generation_time", rank).get(step, 0.0) for rank in ranks)
              for step in metrics.series(rows, "eval_generation_time", ranks[0])}  # fmt: skip
    saved = {checkpoint_dir.step_of(c): c for c in checkpoint_dir.complete_checkpoints(checkpoint_dir.checkpoint_root(run))}
    steps = [s for s in sorted(logged) if s in saved]
    if not steps:
        print(f"{run}: no accuracy evaluation with a checkpoint of its step (checkpoint.every = eval_accuracy_every)",
              file=sys.stderr)  # fmt: skip
        return 2
    print(f"{run}: {len(ranks)} rank(s); today's path: 1 process, one row per generate call, "
          f"{args.threads_per_rank} thread(s)")  # fmt: skip
    print(f"{'step':>6} {'rows':>5} {'in training s':>14} {'one row s':>10} {'speedup':>8}  replies equal")
    total = [0.0, 0.0]
    equal = True
    for step in steps:
        model, processor, cfg, _ = eval_command.load_for_eval(saved[step])
        dataset = qdata.build(cfg, processor).eval_dataset
        want = qgen.read_jsonl(evaluate.generations_path(run, step))
        t0 = time.perf_counter()
        got = qgen.generate_rows(model.eval(), dataset, [r["index"] for r in want], qgen.Sampling.of(cfg.train, batch_size=1))
        seconds = time.perf_counter() - t0
        same = [g.tokens for g in got] == [r["tokens"] for r in want]
        equal &= same
        total[0] += logged[step]
        total[1] += seconds
        print(f"{step:>6} {len(want):>5} {logged[step]:>14.2f} {seconds:>10.2f} {seconds / logged[step]:>7.2f}x  {same}")
    print(f"{'all':>6} {'':>5} {total[0]:>14.2f} {total[1]:>10.2f} {total[1] / total[0]:>7.2f}x  {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
