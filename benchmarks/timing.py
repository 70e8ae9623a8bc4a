"""What the step benchmarks share: timing optimizer steps, and running each variant in a fresh process."""

from __future__ import annotations

import argparse
import statistics
import time

from qwenkit.bench.measure import fresh_process

GiB = 2**30


def step_arguments(p: argparse.ArgumentParser, shapes: list[str]) -> None:
    """The options every step benchmark takes: device, shapes, timed steps, variants, output, and the worker's."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shapes", default=None, choices=shapes,
                   help="default: cpu on CPU, 3b on CUDA; tiny: a seconds-long smoke check")  # fmt: skip
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--variants", nargs="+", default=None)
    p.add_argument("--out", default=None, help="also write the results as JSON lines here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)


def parse(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``argv`` parsed, ``--shapes`` defaulted by the device."""
    args = p.parse_args(argv)
    args.shapes = args.shapes or ("3b" if args.device == "cuda" else "cpu")
    return args


def device_missing(args) -> bool:
    """``--device cuda`` without a CUDA device: said in one line (the benchmark then skips)."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: --device cuda but no CUDA device is available")
        return True
    return False


def timed_steps(forward_backward, opt, device, warmup: int, steps: int) -> tuple[float, list[float]]:
    """``warmup + steps`` optimizer steps (``forward_backward()`` returns the loss, its backward
    done): the median seconds of the timed ones and every step's loss. The SFT, DPO and GRPO workers' one loop."""
    import torch

    times, losses = [], []
    for step in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return statistics.median(times), losses


def spawn(script: str, args, variant: str, *extra: str) -> dict:
    """``script --worker --variant variant`` with ``args``' common options (and ``extra``), in a fresh
    process with the same allocator for every variant; its result row."""
    cmd = [script, "--worker", "--variant", variant, "--device", args.device, "--shapes", args.shapes,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--family", args.family, *extra]  # fmt: skip
    return fresh_process(cmd, f"variant {variant}")
