"""Loss-head benchmark: HF's full-logits loss vs qwenkit's chunked loss, side by side.

Each variant runs in a fresh subprocess (``qwenkit.bench.measure.head_measure``) so its peak memory is its
own: on CPU the peak RSS (VmHWM, reset through /proc/self/clear_refs once the inputs exist), on
an accelerator the allocator's peak. The number reported is the loss head's whole transient:
everything forward + backward allocates beyond the inputs, the lm_head weight gradient included
(V x H x 4 bytes; it bounds any ratio from below). The baseline is HF's own head: ``lm_head``
logits, then ``ForCausalLMLoss`` (its cost does not depend on how many labels are ignored, so it
is measured once per length).

For each share of ignored labels (a leading prompt of -100) it shows the dense chunked head
(every position projected, ``skip_ignored=False``, auto chunk) and the skipping head (only
labelled rows) at each chunk size; ``dense`` and ``/dense`` compare the two.

    python benchmarks/chunk_loss.py                       # Qwen2.5-VL-3B head, S=2048 and 4096; 0/50/90% ignored
    python benchmarks/chunk_loss.py --seq 2048 --ignored 0.5 --chunks 512 768 1024 auto --repeats 1
"""

from __future__ import annotations

import argparse
import sys

from qwenkit.bench.measure import head_case, head_measure
from qwenkit.notebooks.results import write_jsonl

MiB = 2**20
GiB = 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096], help="tokens per step")
    p.add_argument("--chunks", nargs="+", default=["256", "512", "1024", "auto"])
    p.add_argument("--hidden", type=int, default=2048, help="Qwen2.5-VL-3B: 2048")
    p.add_argument("--vocab", type=int, default=151_936, help="Qwen2.5-VL: 151,936")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=0, help="timed passes after the memory pass (0: time that one)")
    p.add_argument("--ignored", type=float, nargs="+", default=[0.0, 0.5, 0.9], help="shares of ignored labels")
    p.add_argument("--out", default=None, help="also write the result rows as JSON lines here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("skipped: --device cuda but no CUDA device is available")
            return 0

    def measure(variant, seq, ignored, skip=True):
        case = head_case(variant, seq, args.hidden, args.vocab, args.dtype, args.device, args.repeats, ignored, skip)
        return head_measure(case)[0]

    weight_grad = args.vocab * args.hidden * 4
    print(f"loss head H={args.hidden} V={args.vocab:,} {args.dtype} on {args.device}; "
          f"lm_head weight grad alone = {weight_grad / GiB:.2f} GiB (in every variant's peak)")
    rows = []
    for seq in args.seq:
        full = measure("full", seq, 0.0)
        rows.append(full)
        for ignored in args.ignored:
            dense = measure("auto", seq, ignored, skip=False)
            print(f"\nS={seq}, {100 * ignored:.0f}% of the labels ignored")
            print(f"{'variant':<16}{'chunk':>7}{'time s':>9}{'peak GiB':>10}{'time/full':>11}{'peak/full':>11}"
                  f"{'time/dense':>12}{'peak/dense':>12}")
            print(f"{'HF full':<16}{'-':>7}{full['time_ms'] / 1e3:>9.2f}{full['peak_mb'] / 1024:>10.2f}"
                  f"{1:>11.2f}{1:>11.2f}{'':>12}{'':>12}")
            for name, r in [("dense auto", dense)] + [(f"skip {c}", measure(c, seq, ignored)) for c in args.chunks]:
                r["time_ratio"] = r["time_ms"] / full["time_ms"]
                r["peak_ratio"] = r["peak_mb"] / full["peak_mb"]
                r["time_vs_dense"] = r["time_ms"] / dense["time_ms"]
                r["peak_vs_dense"] = r["peak_mb"] / dense["peak_mb"]
                rows.append(r)
                print(f"{name:<16}{r['chunk_size']:>7}{r['time_ms'] / 1e3:>9.2f}{r['peak_mb'] / 1024:>10.2f}"
                      f"{r['time_ratio']:>11.2f}{r['peak_ratio']:>11.2f}{r['time_vs_dense']:>12.2f}"
                      f"{r['peak_vs_dense']:>12.2f}")
        c = min(1024, seq)
        floor = weight_grad + seq * args.hidden * 4 + c * args.vocab * 4
        print(f"floor at chunk {c} (grad W + grad h + one chunk): {floor / GiB:.2f} GiB "
              f"= {floor / (full['peak_mb'] * MiB):.2f} of full")
    if args.out:
        write_jsonl(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
