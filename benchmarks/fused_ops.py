"""Fused-op benchmark: patched vs unpatched Qwen2.5-VL, loss/gradient parity and step time.

Both models (same seed, same weights, same batch, chunk-loss head) live in one process and
take turns step by step, so drift (clocks, other jobs) hits both alike; the ratio printed is
the patched model's median forward+backward time over the unpatched one's, and on CUDA the
same for the step's peak allocation above the resident weights. Parity is checked on the
first step: loss and every parameter gradient (relative error of its norm), with tolerances
set by dtype; the script exits 1 when parity fails.

On CUDA the patched model runs Liger's kernels (liger-kernel must be installed, else the
patched model takes the original ops and the ratios are ~1). ``--device cpu`` runs the
fallback path: the parity must then be bit-identical and the ratio ~1; that mode exists so the
script itself is exercised on machines without a GPU.

    python benchmarks/fused_ops.py                      # CUDA, bf16: tiny and ~100M configs
    python benchmarks/fused_ops.py --device cpu         # fallback path, tiny config, fp32
    python benchmarks/fused_ops.py --configs 100m --repeats 20
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time

import torch
from synthetic import make_batch, make_config

# text / vision sizes (as benchmarks/synthetic.py takes them); "100m" is ~100M parameters (text
# ~74M, vision ~25M) with the real layout
SHAPES = {
    "tiny": None,  # the embedded tiny checkpoint's own config
    "100m": dict(
        text=dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=2, mrope_section=[8, 12, 12]),  # head_dim 64: sections sum to 32
        vision=dict(depth=12, hidden_size=384, intermediate_size=1024, num_heads=6, fullatt_block_indexes=[3, 7, 11],
                    tokens_per_second=2),
    ),
}  # fmt: skip
# per sample: 128 / 1024 text tokens around the image's 16 / 256 tokens and its 2 marks
INPUTS = {"tiny": dict(seq=146, image_side=112), "100m": dict(seq=1282, image_side=448)}
# (loss rtol, gradient relative-norm error) when kernels run: bf16 / fp16 keep 8 / 11 mantissa bits
TOLERANCES = {torch.bfloat16: (2e-2, 3e-2), torch.float16: (5e-3, 1e-2), torch.float32: (1e-4, 1e-3)}


def model_config(name: str):
    """The tiny checkpoint's config, or ``SHAPES[name]`` with the tiny checkpoint's vocabulary and token ids."""
    from transformers import AutoConfig

    from qwenkit.model.tiny.checkpoint import ensure_checkpoint

    base = AutoConfig.from_pretrained(ensure_checkpoint(), local_files_only=True)
    if SHAPES[name] is None:
        return base
    tc = base.text_config
    ids = {k: getattr(base, f"{k}_token_id") for k in ("image", "video", "vision_start", "vision_end")}
    return make_config(
        SHAPES[name], vocab=tc.vocab_size, ids=ids, max_positions=8192, rms_norm_eps=1e-6,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id,
    )  # fmt: skip


def build_pair(name: str, args, device, dtype):
    from qwenkit import patches
    from qwenkit.model.families.qwen2_5_vl import QwenkitQwen2_5_VL

    config = model_config(name)
    config._attn_implementation = args.attn
    torch.manual_seed(0)
    reference = QwenkitQwen2_5_VL(config).to(device=device, dtype=dtype).configure_loss(chunk=True)
    fused = copy.deepcopy(reference)
    report = patches.apply(fused)
    return reference, fused, report


def parity(fused, reference, exact: bool, dtype) -> tuple[bool, str]:
    (loss_f, grads_f), (loss_r, grads_r) = fused, reference
    errors = {
        n: ((grads_f[n] - grads_r[n]).norm() / grads_r[n].norm().clamp_min(1e-12)).item() for n in grads_r
    }
    worst = max(errors, key=errors.get)
    loss_rel = abs((loss_f - loss_r) / loss_r).item()
    text = f"loss {loss_r.item():.5f} vs {loss_f.item():.5f} (rel {loss_rel:.2e}); worst grad {worst}: {errors[worst]:.2e}"
    if exact:
        same = torch.equal(loss_f, loss_r) and all(torch.equal(grads_f[n], grads_r[n]) for n in grads_r)
        return same, ("bit-identical; " if same else "NOT bit-identical; ") + text
    loss_tol, grad_tol = TOLERANCES[dtype]
    ok = grads_f.keys() == grads_r.keys() and loss_rel <= loss_tol and errors[worst] <= grad_tol
    return ok, text + f" (tolerance {loss_tol:g} / {grad_tol:g})"


def timed_step(model, batch, device) -> tuple[float, int]:
    """Seconds and peak bytes allocated above the resident state (CUDA; 0 elsewhere)."""
    from qwenkit.device import memory_bytes, reset_peak_memory

    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = memory_bytes(device, peak=False)
        reset_peak_memory(device)
    t0 = time.perf_counter()
    model(**batch).loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return seconds, (memory_bytes(device, peak=True) - base if device.type == "cuda" else 0)


def run(name: str, args, device, dtype) -> bool:
    from qwenkit.bench.step import loss_and_grads

    reference, fused, report = build_pair(name, args, device, dtype)
    n_params = sum(p.numel() for p in reference.parameters())
    inputs = INPUTS[name]
    batch = make_batch(reference.config, inputs["seq"], inputs["image_side"], samples=args.batch, device=device)
    print(f"\n== {name}: {n_params / 1e6:.1f}M parameters, {dtype} on {device}, batch {args.batch} x "
          f"{batch['input_ids'].shape[1]} tokens ({inputs['image_side']} px image each)")  # fmt: skip
    print(report)
    route = report.routes.get(device.type, report.routes["other devices"])
    if route.startswith("original"):
        print(f"note: {device.type} tensors run the original ops here ({route}): expect ratios ~1")
    # the CPU fallback is HF's code, so bitwise; CUDA backward kernels are not deterministic bitwise
    exact = device.type == "cpu"
    ok, text = parity(loss_and_grads(fused, batch), loss_and_grads(reference, batch), exact, dtype)
    print(f"parity: {'ok' if ok else 'FAILED'}: {text}")

    times = {"original": [], "patched": []}
    peaks = {"original": [], "patched": []}
    for i in range(args.warmup + args.repeats):
        for label, model in (("original", reference), ("patched", fused)):
            seconds, peak = timed_step(model, batch, device)
            if i >= args.warmup:
                times[label].append(seconds)
                peaks[label].append(peak)
    t_orig, t_fused = statistics.median(times["original"]), statistics.median(times["patched"])
    print(f"step time (median of {args.repeats}): original {t_orig * 1e3:.1f} ms, patched {t_fused * 1e3:.1f} ms, "
          f"patched/original {t_fused / t_orig:.3f}")  # fmt: skip
    if device.type == "cuda":
        p_orig, p_fused = max(peaks["original"]), max(peaks["patched"])
        print(f"step peak above resident: original {p_orig / 2**20:.0f} MiB, patched {p_fused / 2**20:.0f} MiB, "
              f"patched/original {p_fused / p_orig:.3f}")  # fmt: skip
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--configs", nargs="+", choices=tuple(SHAPES), default=None,
                   help="default: tiny 100m on cuda, tiny on cpu")  # fmt: skip
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    p.add_argument("--attn", default="sdpa", help="attention implementation (sdpa, eager, flash_attention_2)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per model (default: 3 cuda, 1 cpu)"
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed steps per model (default: 10 cuda, 3 cpu)"
    )
    args = p.parse_args(argv)
    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        print(
            "skipped: --device cuda but no CUDA device is available (use --device cpu for the fallback path)"
        )
        return 0
    args.configs = args.configs or (["tiny", "100m"] if on_cuda else ["tiny"])
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_cuda else "float32"))
    args.warmup = args.warmup if args.warmup is not None else (3 if on_cuda else 1)
    args.repeats = args.repeats if args.repeats is not None else (10 if on_cuda else 3)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    device = torch.device(args.device)
    results = [run(name, args, device, dtype) for name in args.configs]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
