"""Qwen3.5's linear attention on a packed row vs HF's PyTorch fallback on the same samples unpacked.

One Gated DeltaNet layer's two sequence ops, forward + backward, on samples of log-normal lengths
(median ~``--median`` tokens), at the 9B's head sizes (16 key heads, 32 value heads, dim 128):

- ``unpacked``: HF's own fallbacks (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``) on the
  right-padded batch ``[n, L_max]``, what a padded micro-batch runs;
- ``varlen``: :mod:`qwenkit.model.families.linear_attention` on the packed row ``[1, ΣL]`` with the sample
  boundaries (each sample from a zero conv window and state; on CPU this is HF's fallback on the
  samples side by side, plus the scatter into and out of that layout).

It prints the median seconds of each and the ratio (issue 42's target: varlen <= 1.1x unpacked).

    python benchmarks/linear_attention.py                       # ~1 min on 2 cores
    python benchmarks/linear_attention.py --samples 4 --median 64 --heads 4   # a smoke check
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import torch

from qwenkit.model.families import linear_attention as la


def lengths(n: int, median: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [max(2, int(median * float(torch.exp(torch.randn(1, generator=g) * 0.6)))) for _ in range(n)]


def streams(total: int, heads: int, dim: int = 128, seed: int = 0):
    """``[1, T, ...]`` conv input (channels: q, k, v) and delta-rule inputs of one packed row, with grads."""
    g = torch.Generator().manual_seed(seed)
    channels = 2 * heads * dim + 2 * heads * dim
    x = torch.randn(1, channels, total, generator=g)
    w = torch.randn(channels, 4, generator=g) * 0.5
    q, k = (torch.randn(1, total, heads, dim, generator=g) for _ in range(2))
    v = torch.randn(1, total, 2 * heads, dim, generator=g)
    decay, beta = -torch.rand(1, total, 2 * heads, generator=g), torch.rand(1, total, 2 * heads, generator=g)
    return [t.requires_grad_() for t in (x, w, q, k, v, decay, beta)]


def unpacked(module, x, w, q, k, v, decay, beta):
    """HF's fallbacks on the padded batch (built outside the timing: a padded micro-batch arrives padded)."""
    conv = la._fallback(module, la.CONV)(x, w, None, activation="silu")
    out, _ = la._fallback(module, la.DELTA)(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    return conv, out


def varlen(module, cu, x, w, q, k, v, decay, beta):
    conv = module.causal_conv1d_fn(x, w, None, activation="silu", cu_seq_lens_q=cu)
    out, _ = module.torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return conv, out


def timed(fn, inputs, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        outputs = fn(*inputs)
        sum(o.sum() for o in outputs).backward()
        times.append(time.perf_counter() - t0)
        for t in inputs:
            t.grad = None
    return statistics.median(times[1:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--median", type=int, default=400, help="median sample length in tokens")
    p.add_argument("--heads", type=int, default=16, help="key heads (value heads: twice as many)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    la.install()
    module = importlib.import_module(la.MODULES[0])
    sizes = lengths(args.samples, args.median)
    cu = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
    packed = streams(sum(sizes), args.heads)
    layout = la._layout(cu, sum(sizes))
    with torch.no_grad():  # the padded batch of the same samples, as a padded micro-batch holds them
        x = la.to_padded(packed[0].transpose(1, 2), layout).transpose(1, 2)
        padded = [x, packed[1], *(la.to_padded(t, layout) for t in packed[2:])]
    padded = [t.clone().requires_grad_() for t in padded]
    t_unpacked = timed(lambda *a: unpacked(module, *a), padded, args.repeats)
    t_varlen = timed(lambda *a: varlen(module, cu, *a), packed, args.repeats)
    print(f"{args.samples} samples, {sum(sizes)} tokens (longest {max(sizes)}), {args.heads} key heads x 128; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"unpacked (HF's fallback, [n, L_max]): {t_unpacked:.3f} s   varlen (packed row): {t_varlen:.3f} s   "
          f"varlen / unpacked: {t_varlen / t_unpacked:.2f} (target <= 1.1)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
