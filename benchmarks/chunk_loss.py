"""Loss-head benchmark: HF's full-logits loss vs qwenkit's chunked loss, side by side.

Each variant runs in a fresh subprocess so its peak memory is its own: on CPU the peak RSS
(VmHWM, reset through /proc/self/clear_refs after the inputs exist), on CUDA the allocator's
peak. The number reported is the loss head's whole transient: everything forward + backward
allocates beyond the inputs, the lm_head weight gradient included (V x H x 4 bytes; it bounds
any ratio from below). Times are the median of ``--repeats`` forward+backward passes.

    python benchmarks/chunk_loss.py                       # Qwen2.5-VL-3B head, S=2048 and 4096
    python benchmarks/chunk_loss.py --seq 1024 --chunks 512 auto --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GiB = 2**30


def _rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(args) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers.loss.loss_utils import ForCausalLMLoss

    from qwenkit.loss import auto_chunk_size, chunked_linear_cross_entropy

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    n, h, v = args.seq, args.hidden, args.vocab
    # in place, so no temporary inflates the baseline
    weight = torch.empty(v, h, device=device, dtype=dtype).normal_().mul_(0.02).requires_grad_()
    hidden = torch.empty(1, n, h, device=device, dtype=dtype).normal_().requires_grad_()
    labels = torch.randint(0, v, (1, n), device=device)
    labels[:, : n // 4] = -100  # a prompt that is not learned

    if args.variant == "full":

        def step():
            logits = F.linear(hidden, weight)  # [1, N, V]: what HF's lm_head returns
            return ForCausalLMLoss(logits, labels, vocab_size=v)

        chunk = None
    else:
        chunk = auto_chunk_size(n, v, 512 * 2**20) if args.variant == "auto" else int(args.variant)

        def step():
            return chunked_linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)

    def run_once() -> float:
        weight.grad = hidden.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    if device.type == "cuda":
        run_once()  # cuBLAS / allocator warm-up, not counted
        weight.grad = hidden.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = [run_once() for _ in range(args.repeats)]
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = _status("VmRSS")
        _rss_peak_reset()
        times = [run_once() for _ in range(args.repeats)]
        peak = _status("VmHWM") - base
    return {"variant": args.variant, "seq": n, "chunk": chunk, "time_s": statistics.median(times), "peak_bytes": peak}


def _spawn(args, variant: str, seq: int) -> dict:
    cmd = [
        sys.executable, __file__, "--worker", "--variant", variant, "--seq", str(seq),
        "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype", args.dtype,
        "--device", args.device, "--repeats", str(args.repeats),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if out.returncode != 0:
        raise RuntimeError(f"variant {variant} at seq {seq} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096], help="tokens per step")
    p.add_argument("--chunks", nargs="+", default=["256", "512", "1024", "auto"])
    p.add_argument("--hidden", type=int, default=2048, help="Qwen2.5-VL-3B: 2048")
    p.add_argument("--vocab", type=int, default=151_936, help="Qwen2.5-VL: 151,936")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per variant (median)")
    p.add_argument("--out", default=None, help="also write the results as JSON lines here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="full", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.seq = args.seq[0]
        print(json.dumps(worker(args)))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("skipped: --device cuda but no CUDA device is available")
            return 0

    weight_grad = args.vocab * args.hidden * 4
    print(f"loss head H={args.hidden} V={args.vocab:,} {args.dtype} on {args.device}; "
          f"lm_head weight grad alone = {weight_grad / GiB:.2f} GiB (in every variant's peak)")
    rows = []
    for seq in args.seq:
        full = _spawn(args, "full", seq)
        rows.append(full)
        print(f"\nS={seq}")
        print(f"{'variant':<14}{'chunk':>7}{'time s':>9}{'peak GiB':>10}{'time/full':>11}{'peak/full':>11}")
        print(f"{'HF full':<14}{'-':>7}{full['time_s']:>9.2f}{full['peak_bytes'] / GiB:>10.2f}{1:>11.2f}{1:>11.2f}")
        for chunk in args.chunks:
            r = _spawn(args, chunk, seq)
            r["time_ratio"] = r["time_s"] / full["time_s"]
            r["peak_ratio"] = r["peak_bytes"] / full["peak_bytes"]
            rows.append(r)
            name = f"chunked {chunk}"
            print(f"{name:<14}{r['chunk']:>7}{r['time_s']:>9.2f}{r['peak_bytes'] / GiB:>10.2f}"
                  f"{r['time_ratio']:>11.2f}{r['peak_ratio']:>11.2f}")
        floor = weight_grad + seq * args.hidden * 4 + min(1024, seq) * args.vocab * 4
        print(f"floor at chunk {min(1024, seq)} (grad W + grad h + one chunk): {floor / GiB:.2f} GiB "
              f"= {floor / full['peak_bytes']:.2f} of full")
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
