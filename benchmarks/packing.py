"""Packing benchmark: padded micro-batches vs padding-free rows vs a token budget, same samples.

A long-tailed set of SFT-like samples (log-normal lengths: median ~400, p95 ~2,000 tokens,
capped at ``--max-length``; 0-2 images each) is trained for one epoch (forward + backward of
every micro-batch) on the text-1024 x 4-layer model with Qwen's vocabulary (V = 151,936) and the
chunked loss head, as ``benchmarks/train_step.py`` builds it. Variants, each in a fresh process:

- ``padded``: ``train.micro_batch_size=4``, right-padded (qwenkit's default);
- ``packed``: the same micro-batches of 4, padding-free (``data.packing=true``);
- ``budget``: padding-free micro-batches filled to ``--max-tokens`` tokens
  (``data.max_tokens_per_batch``, longest first within the shuffled epoch).

It prints, per variant, the padding fraction (pad positions / positions computed), effective
(non-pad) tokens/s, the process's peak memory, and the ratios to ``padded``. The optimizer step
is left out: its cost per step does not depend on how the samples are laid out.

    flock /tmp/qwenkit-bench.lock python benchmarks/packing.py            # ~5-8 min on 2 cores
    python benchmarks/packing.py --samples 8 --variants padded packed     # quicker look
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from types import SimpleNamespace

from synthetic import IMAGE_PAD, VISION_END, VISION_START, make_config
from train_step import CPU_SHAPES

from qwenkit.bench.measure import fresh_process
from qwenkit.device import memory_bytes

GiB = 2**30
PAD = 151_643  # <|endoftext|>
MERGE = 2  # spatial merge: 4 patches per image token


def make_samples(n: int, max_length: int, seed: int) -> list[dict]:
    """``n`` samples as ``qwenkit.data.EncodedDataset`` yields them (text, 0-2 images, learned reply)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    sigma = math.log(2000 / 400) / 1.645  # median 400, p95 2,000
    samples = []
    for _ in range(n):
        length = int(min(max_length, max(64, math.exp(math.log(400) + sigma * float(torch.randn(1, generator=g))))))
        ids, types, pixels, grids = [], [], [], []
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):
            side = int(torch.randint(4, 9, (1,), generator=g)) * 2  # grid 8..16 patches a side
            tokens = side * side // MERGE**2
            if len(ids) + tokens + 2 + 32 > length:
                break
            text = int(torch.randint(0, 16, (1,), generator=g))
            ids += torch.randint(0, 150_000, (text,), generator=g).tolist() + [VISION_START]
            ids += [IMAGE_PAD] * tokens + [VISION_END]
            types += [0] * (text + 1) + [1] * tokens + [0]
            pixels.append(torch.randn(side * side, 3 * 2 * 14 * 14, generator=g))
            grids.append([1, side, side])
        rest = length - len(ids)
        ids += torch.randint(0, 150_000, (rest,), generator=g).tolist()
        types += [0] * rest
        input_ids = torch.tensor(ids)
        labels = input_ids.clone()
        labels[: len(ids) - rest // 2] = -100  # the reply (second half of the trailing text) is learned
        sample = {"input_ids": input_ids, "labels": labels, "mm_token_type_ids": torch.tensor(types)}
        if grids:
            sample["pixel_values"] = torch.cat(pixels)
            sample["image_grid_thw"] = torch.tensor(grids)
        samples.append(sample)
    return samples


def plan(variant: str, lengths: list[int], args) -> list[list[int]]:
    """The epoch's micro-batches of sample indices, as qwenkit's samplers make them."""
    from qwenkit.data import FixedSizeSampler, TokenBudgetSampler

    if variant == "budget":
        return TokenBudgetSampler(lengths, args.max_tokens, args.seed, packed=True).epoch_batches(0)
    return FixedSizeSampler(len(lengths), args.micro_batch, args.seed).epoch_batches(0)


def worker(args) -> dict:
    import torch

    from qwenkit.data import Collator
    from qwenkit.model.families.qwen2_5_vl import QwenkitQwen2_5_VL

    config = make_config(CPU_SHAPES)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = QwenkitQwen2_5_VL(config).configure_loss(chunk=True, chunk_size="auto").train()
    samples = make_samples(args.samples, args.max_length, args.seed)
    batches = plan(args.variant, [len(s["input_ids"]) for s in samples], args)
    collate = Collator(SimpleNamespace(pad_token_id=PAD), packing=args.variant != "padded")
    micro = [collate([samples[i] for i in b]) for b in batches]
    real = sum(len(s["input_ids"]) for s in samples)
    positions = sum(b["input_ids"].numel() for b in micro)
    labelled = sum(int(b["num_items"]) for b in micro)

    def step(batch):
        batch = dict(batch)
        batch.pop("num_samples")
        (model(**batch, num_items_in_batch=labelled).loss).backward()

    step(collate([make_samples(1, 256, seed=args.seed + 1)[0]]))  # warm-up: allocator, kernels
    times = []
    for _ in range(args.repeats):
        began = time.perf_counter()
        for batch in micro:
            step(batch)
        times.append(time.perf_counter() - began)
        model.zero_grad(set_to_none=False)  # keep the gradient buffers: every repeat starts alike
    return {
        "variant": args.variant, "epoch_s": statistics.median(times), "peak_bytes": memory_bytes("cpu", peak=True),
        "real_tokens": real, "positions": positions, "micro_batches": len(micro),
        "largest_micro_batch": max(b["input_ids"].numel() for b in micro),
    }  # fmt: skip


def _spawn(args, variant: str) -> dict:
    cmd = [__file__, "--worker", "--variant", variant, "--samples", str(args.samples),
           "--max-length", str(args.max_length), "--max-tokens", str(args.max_tokens), "--seed", str(args.seed),
           "--micro-batch", str(args.micro_batch), "--repeats", str(args.repeats)]  # fmt: skip
    return fresh_process(cmd, f"variant {variant}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=16, help="samples in the epoch (a multiple of --micro-batch)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=4096, help="data.max_length: longer samples are cut")
    p.add_argument("--max-tokens", type=int, default=4096, help="data.max_tokens_per_batch of the budget variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="timed epochs per variant (median)")
    p.add_argument("--variants", nargs="+", default=["padded", "packed", "budget"])
    p.add_argument("--out", default=None, help="also write the results as JSON lines here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="padded", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    from qwenkit.notebooks.results import write_jsonl

    lengths = sorted(len(s["input_ids"]) for s in make_samples(args.samples, args.max_length, args.seed))
    print(f"text-1024 x 4 layers, V=151,936, chunk loss, fp32 CPU; {args.samples} samples, lengths: "
          f"median {statistics.median(lengths):.0f}, max {lengths[-1]}, total {sum(lengths):,} tokens")  # fmt: skip
    rows = [_spawn(args, v) for v in args.variants]
    base = rows[0]
    print(f"\n{'variant':<9}{'micro-batches':>14}{'largest':>9}{'padding':>9}{'eff tok/s':>11}{'peak GiB':>10}"
          f"{'tok/s ratio':>13}{'mem ratio':>11}")  # fmt: skip
    for r in rows:
        r["padding_fraction"] = 1 - r["real_tokens"] / r["positions"]
        r["effective_tokens_per_s"] = r["real_tokens"] / r["epoch_s"]
        r["speedup"] = r["effective_tokens_per_s"] / (base["real_tokens"] / base["epoch_s"])
        r["mem_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        print(f"{r['variant']:<9}{r['micro_batches']:>14}{r['largest_micro_batch']:>9}{r['padding_fraction']:>9.1%}"
              f"{r['effective_tokens_per_s']:>11.0f}{r['peak_bytes'] / GiB:>10.2f}{r['speedup']:>13.2f}"
              f"{r['mem_ratio']:>11.2f}")  # fmt: skip
    if args.out:
        write_jsonl(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
