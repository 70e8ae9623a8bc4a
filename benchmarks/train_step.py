"""End-to-end training-step benchmark: HF baseline vs qwenkit chunk loss (± recompute).

Every variant runs in a fresh subprocess with the same config, seed, weights and batch:

- ``hf``: stock ``Qwen2_5_VLForConditionalGeneration`` with labels (full logits), AdamW;
- ``chunk-dense``: qwenkit's chunked head projecting every position (the head before it learned
  to skip ignored labels);
- ``chunk``: qwenkit's model, chunked loss head projecting only the labelled positions;
- ``chunk+recompute``: the same with non-reentrant activation checkpointing of the decoder
  layers and vision blocks;
- ``chunk-foreach`` (on request): chunk loss with HF's optimizer, to separate the two savings;
- ``lora``: the ``chunk`` step with peft LoRA adapters (r = 16, alpha 32, every linear of the
  language model) added by :func:`qwenkit.model.lora.apply`; base weights and lm_head frozen, so
  neither their gradients nor AdamW state exist (its first loss equals ``chunk``'s: B = 0).

Every variant runs with the allocator setting ``qwenkit train`` gives CPU ranks
(``MALLOC_MMAP_THRESHOLD_``, see ``qwenkit.launch``), unless the caller's environment sets it.
The qwenkit variants use the optimizer qwenkit trains with (fused AdamW, in place); the HF
baseline uses plain AdamW, whose foreach step allocates a parameter-sized temporary.

The batch is one image-text sample whose prompt and image are ignored (-100), as in SFT; the
share of ignored labels is printed. It prints the median step time, tokens/s, the process's peak memory (whole step: weights,
gradients, AdamW state, activations, loss head) and the ratios to HF, the memory floor
(weights + gradients + AdamW state + one logits chunk), and model FLOPs utilisation. Model FLOPs
are counted as notebook 04 counts them (:func:`qwenkit.bench.step.step_flops`, torch's flop
counter on one forward + backward of each variant before recompute or Liger is switched on): a
head that skips ignored labels is credited with the rows it projects; recomputation is not counted.

MFU is against a matmul peak each worker measures next to its own timed steps: a 4096^3 GEMM
(best of several) just before and just after them, the better of the two. One peak measured
once in the driver put a busy moment into every variant's MFU (1.17 in one run, 0.53 in
another). An MFU above 1 is not a result but a peak measured too low (the machine was busy
then): such a row prints ``error`` in its MFU column and the reason below the table.

    python benchmarks/train_step.py                       # CPU config: text 1024 x 4 layers, V=151,936, S=2048
    python benchmarks/train_step.py --device cuda         # Qwen2.5-VL-3B shapes in bf16 (+ Liger FLCE if installed)
    python benchmarks/train_step.py --family qwen3_vl     # the same CPU shapes on Qwen3-VL (DeepStack, 16-px patches)
    python benchmarks/train_step.py --family qwen3_5      # Qwen3.5: Gated DeltaNet layers, 248,320 vocabulary

DPO's and GRPO's steps and GRPO's rollouts: ``benchmarks/dpo_grpo_step.py``.
"""

from __future__ import annotations

import argparse
import json
import sys

from synthetic import CONFIGS, QWEN_ORDINARY, SHAPES, make_batch
from timing import GiB, device_missing, parse, spawn, step_arguments, timed_steps

from qwenkit.bench.step import mfu

SKIPPING = ("chunk", "chunk+recompute", "chunk-foreach", "lora")  # variants whose head projects only labelled rows


def worker(args) -> dict:
    import torch

    from qwenkit.bench.measure import matmul_peak
    from qwenkit.bench.step import step_flops
    from qwenkit.device import memory_bytes, reset_peak_memory
    from qwenkit.model.families import registry as families

    shapes = SHAPES[args.shapes]
    device = torch.device(args.device)
    dtype = getattr(torch, shapes["dtype"])
    config = CONFIGS[args.family](shapes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    if args.variant == "hf" or args.variant == "liger":
        model = families.get(args.family).load("hf_class")(config)
    else:
        model = families.get(args.family).load("subclass")(config).configure_loss(chunk=True, chunk_size="auto")
        model.lm_head.skip_ignored = args.variant in SKIPPING
    model.to(device=device, dtype=dtype).train()
    if args.variant == "lora":
        from qwenkit import config as qconfig
        from qwenkit.model import lora

        lora.apply(model, qconfig.load(overrides=["lora.r=16", "lora.alpha=32"]).lora, seed=0)
    batch = make_batch(config, shapes["seq"], shapes["image_side"], learn_prompt=False, ordinary=QWEN_ORDINARY, device=device)
    flops = step_flops(model, batch)  # before recompute (not model FLOPs) and Liger (kernels it cannot see)
    if args.variant == "chunk+recompute":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2_5_vl

        apply_liger_kernel_to_qwen2_5_vl(model=model, fused_linear_cross_entropy=True, rms_norm=False,
                                         swiglu=False, rope=False)  # fmt: skip
    # HF baseline: plain AdamW (foreach: one full-size temporary in step()). qwenkit trains with
    # the fused AdamW, which updates in place; "chunk-foreach" shows the loss head alone.
    fused = args.variant.startswith(("chunk", "lora")) and not args.variant.endswith("foreach")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=fused or None)
    gemm_before = matmul_peak(device, dtype, size=args.gemm_size)["flops_per_s"]  # next to the timed steps (see the docstring)
    reset_peak_memory(device)  # the GEMM's operands are freed: the step's peak starts from here
    def forward_backward():
        loss = model(**batch).loss
        loss.backward()
        return loss

    step_s, losses = timed_steps(forward_backward, opt, device, args.warmup, args.steps)
    peak = memory_bytes(device, peak=True)
    gemm_after = matmul_peak(device, dtype, size=args.gemm_size)["flops_per_s"]  # after the memory peak is read
    n_params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "variant": args.variant, "step_s": step_s, "peak_bytes": peak, "params": n_params,
        "param_bytes": n_params * torch.finfo(dtype).bits // 8, "trainable": trainable, "losses": losses,
        "tokens": shapes["seq"], "flops": flops,
        "optimizer": "AdamW fused" if fused else "AdamW foreach",
        "gemm_flops_per_s": max(gemm_before, gemm_after), "gemm_before": gemm_before, "gemm_after": gemm_after,
    }  # fmt: skip


def _mfu_cell(value: float | None, width: int) -> str:
    return f"{value:>{width}.2f}" if value is not None else f"{'error':>{width}}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step_arguments(p, list(SHAPES))
    p.add_argument("--gemm-size", type=int, default=4096, help="side of the square GEMM the MFU peak is measured with")
    p.add_argument("--family", default="qwen2_5_vl", choices=list(CONFIGS), help="the model family (model.name)")
    args = parse(p, argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if device_missing(args):
        return 0
    shapes = SHAPES[args.shapes]
    variants = args.variants or ["hf", "chunk-dense", "chunk", "chunk+recompute", "lora"]
    if args.device == "cuda" and args.variants is None:
        try:
            import liger_kernel  # noqa: F401

            variants.append("liger")
        except ImportError:
            print("note: liger-kernel not installed; its fused linear cross-entropy is not compared")
    from qwenkit.model.losses.cross_entropy import auto_chunk_size
    from qwenkit.notebooks.results import write_jsonl

    config = CONFIGS[args.family](shapes)
    labels = make_batch(config, shapes["seq"], shapes["image_side"], learn_prompt=False, ordinary=QWEN_ORDINARY)["labels"]
    valid = int((labels[:, 1:] != -100).sum())  # positions the skipping head projects
    print(f"batch: {labels.numel()} tokens, {valid} labelled, {1 - valid / labels.numel():.0%} of the labels ignored")
    vocab = config.get_text_config().vocab_size
    print(f"family={args.family} shapes={args.shapes} dtype={shapes['dtype']} seq={shapes['seq']} vocab={vocab:,} device={args.device}; "
          "MFU against each worker's own GEMM peak")
    rows = [spawn(__file__, args, v, "--gemm-size", str(args.gemm_size)) for v in variants]
    base = rows[0]
    print(f"\n{'variant':<17}{'optimizer':>15}{'step s':>8}{'tok/s':>9}{'peak GiB':>10}{'time/HF':>9}{'mem/HF':>8}"
          f"{'TFLOP':>7}{'GEMM GF/s':>11}{'MFU':>7}{'first loss':>12}")
    errors = []
    for r in rows:
        r["time_ratio"] = r["step_s"] / base["step_s"]
        r["mem_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        peak = r["gemm_flops_per_s"]  # this worker's own, measured around its steps
        r["mfu"] = mfu(r["flops"], r["step_s"], peak)
        if r["mfu"] is None:
            errors.append(r)
        print(f"{r['variant']:<17}{r['optimizer']:>15}{r['step_s']:>8.2f}{r['tokens'] / r['step_s']:>9.0f}{r['peak_bytes'] / GiB:>10.2f}"
              f"{r['time_ratio']:>9.2f}{r['mem_ratio']:>8.2f}{r['flops'] / 1e12:>7.2f}{peak / 1e9:>11,.0f}"
              f"{_mfu_cell(r['mfu'], 7)}{r['losses'][0]:>12.5f}")
    for r in errors:
        print(f"measurement error ({r['variant']}): the step ran {r['flops'] / r['step_s'] / 1e9:,.0f} "
              f"GFLOP/s, above the GEMM peak measured around it ({r['gemm_before'] / 1e9:,.0f} before, "
              f"{r['gemm_after'] / 1e9:,.0f} after): the machine was busy; rerun it on a quiet one")
    by_name = {r["variant"]: r for r in rows}
    if "chunk" in by_name and "chunk-dense" in by_name:
        skip, dense = by_name["chunk"], by_name["chunk-dense"]
        print(f"\nskipping head vs dense chunk head: time {skip['step_s'] / dense['step_s']:.2f}x, "
              f"peak {skip['peak_bytes'] / dense['peak_bytes']:.2f}x")
    if "chunk" in by_name and "lora" in by_name:
        full, lo = by_name["chunk"], by_name["lora"]
        print(f"lora (r=16, all-linear) vs full chunk-loss step: time {lo['step_s'] / full['step_s']:.2f}x (target <= 0.85), "
              f"peak {lo['peak_bytes'] / full['peak_bytes']:.2f}x (target <= 0.55), trainable parameters "
              f"{lo['trainable']:,} of {lo['params']:,}; first losses {lo['losses'][0]:.6f} vs {full['losses'][0]:.6f}")
    pb = base["param_bytes"]
    chunk = auto_chunk_size(valid, vocab, 512 * 2**20) * vocab * 4
    floor = 4 * pb + chunk
    print(f"\nfloor: weights + grads + AdamW (2 states) = 4 x {pb / GiB:.2f} GiB, + one logits chunk "
          f"{chunk / GiB:.2f} GiB = {floor / GiB:.2f} GiB ({floor / base['peak_bytes']:.2f} of HF's peak)")
    if args.out:
        write_jsonl(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
