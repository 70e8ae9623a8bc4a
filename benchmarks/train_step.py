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

With ``--objective dpo`` the batch is one preference pair: two rows of ``seq`` tokens sharing
the prompt and its image, with different replies, and the step is DPO's (sigmoid, beta 0.1):

- ``dpo-hf``: DPO as TRL computes it: the policy's forward on both rows (full ``[2, S, V]``
  logits), the reference's (a frozen copy of the starting model) under ``no_grad``, each
  reduced by a ``log_softmax`` gather (:func:`qwenkit.model.losses.logps.full_sequence_logps`), plain AdamW;
- ``dpo``: qwenkit's step: ``sequence_logps`` (per-sequence sums from the chunked head, no
  logits in forward or backward) of the policy and of the frozen reference copy, fused AdamW;
- ``dpo-precompute``: qwenkit's step with ``dpo.precompute_ref: true``: the reference log-probs
  computed once before training (by the starting weights), no reference copy and no reference
  forward in the step;
- ``dpo-lora``: the same with LoRA (r = 16, all-linear): the reference is the policy with its
  adapters disabled (no second copy).

Targets: ``dpo`` peak <= 0.5x and time <= 0.8x ``dpo-hf``; ``dpo-lora`` peak <= 0.35x ``dpo-hf``.

With ``--objective grpo`` the batch is the same two rows, two completions of one prompt (a group
of 2, advantages +1 and -1), and the step is GRPO's learner step (dapo, beta 0.04, the reference a
frozen copy): ``grpo-hf`` takes per-token log-probs from full ``[2, S, V]`` logits (TRL's
``selective_log_softmax``), ``grpo`` from the chunked head (``token_logps``, no logits), ``grpo-lora``
the same with LoRA (r = 16, all-linear), the reference being the policy with its adapters disabled. Target:
``grpo`` peak <= 0.5x ``grpo-hf``. Then the rollouts, on the same model FSDP2-sharded in a one-rank
process group, each variant ``--rollout-prompts`` prompts (the batch's prompt and image) x 2
completions of the batch's completion length (the end token suppressed: full length):

- ``rollout-lockstep``: the rollout as it was before issue 51: one ``generate`` call per prompt's
  group, on the sharded model in lockstep (every unit all-gathered at every forward), HF's sampling;
- ``rollout``: :class:`qwenkit.engine.rollouts.hf.HfRollouts` with ``where=gather``: every unit
  gathered once for the rollout (:func:`qwenkit.distributed.unshard.unsharded`), every completion of
  every prompt in one batched ``generate`` call, each drawn from its own seeded generator;
- ``rollout-bf16``: the same under bf16 autocast (``grpo.rollout_dtype: bfloat16``): each weight cast
  once for the rollout, the sampler's log-probs kept for GRPO's importance-sampling correction.

Each prints its seconds, completion tokens per second, the FSDP2 all-gathers of the rollout
(:func:`qwenkit.bench.collectives.count_all_gathers`: unit gathers, counted the same on one rank as
on many) and its peak, and the step's split: a step of ``P`` prompts is their rollout and ``P``
learner micro-batches of one group (the ``grpo`` variant's step time x ``P``). Targets: the rollout's
share of the step <= 35%, tokens/s >= 4x ``rollout-lockstep``'s, all-gathers independent of the
completion length. ``rollout-lockstep`` makes one call per prompt, so its tokens/s do not depend
on ``P``: ``--lockstep-prompts`` (default 1) keeps it short.

    python benchmarks/train_step.py                       # CPU config: text 1024 x 4 layers, V=151,936, S=2048
    python benchmarks/train_step.py --device cuda         # Qwen2.5-VL-3B shapes in bf16 (+ Liger FLCE if installed)
    python benchmarks/train_step.py --objective dpo       # one pair of 2 x 2,048 tokens sharing an image prompt
    python benchmarks/train_step.py --objective grpo      # GRPO's learner step on two completions of 2,048 tokens
    python benchmarks/train_step.py --family qwen3_vl     # the same CPU shapes on Qwen3-VL (DeepStack, 16-px patches)
    python benchmarks/train_step.py --family qwen3_5      # Qwen3.5: Gated DeltaNet layers, 248,320 vocabulary
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

from synthetic import QWEN_ORDINARY, VOCAB, make_batch, make_config

from qwenkit.bench.measure import fresh_process
from qwenkit.bench.step import mfu

GiB = 2**30

CPU_SHAPES = dict(
    text=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=2, mrope_section=[8, 12, 12]),
    vision=dict(depth=2, hidden_size=256, intermediate_size=688, num_heads=4, fullatt_block_indexes=[1]),
    image_side=224, seq=2048, dtype="float32", tie=False,
)  # fmt: skip
GPU_3B_SHAPES = dict(  # Qwen2.5-VL-3B-Instruct
    text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
              num_key_value_heads=2, mrope_section=[16, 24, 24]),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, fullatt_block_indexes=[7, 15, 23, 31]),
    image_side=448, seq=4096, dtype="bfloat16", tie=True,
)  # fmt: skip
TINY_SHAPES = dict(  # a smoke check of the script in seconds (--shapes tiny), not a measurement
    text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, mrope_section=[4, 6, 6]),
    vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, fullatt_block_indexes=[1]),
    image_side=64, seq=256, dtype="float32", tie=False,
)  # fmt: skip
SHAPES = {"cpu": CPU_SHAPES, "3b": GPU_3B_SHAPES, "tiny": TINY_SHAPES}
SKIPPING = ("chunk", "chunk+recompute", "chunk-foreach", "lora")  # variants whose head projects only labelled rows


DPO_VARIANTS = ("dpo-hf", "dpo", "dpo-precompute", "dpo-lora")
DPO_BETA = 0.1
GRPO_VARIANTS = ("grpo-hf", "grpo", "grpo-lora")
ROLLOUT_VARIANTS = ("rollout-lockstep", "rollout", "rollout-bf16")


def pair_batch(config, seq: int, image_side: int, device="cpu") -> dict:
    """One preference pair: rows 0 (chosen) and 1 (rejected) share the prompt and its image; the replies differ."""
    batch = make_batch(config, seq, image_side, samples=2, learn_prompt=False, ordinary=QWEN_ORDINARY)
    prompt = int((batch["labels"][0] == -100).sum())  # the prompt text, the image span
    batch["input_ids"][1, :prompt] = batch["input_ids"][0, :prompt]
    batch["labels"][1, :prompt] = -100
    batch["mm_token_type_ids"][1] = batch["mm_token_type_ids"][0]
    half = batch["pixel_values"].shape[0] // 2
    batch["pixel_values"][half:] = batch["pixel_values"][:half]
    return {k: v.to(device) for k, v in batch.items()}


def dpo_step(policy_logps, reference_logps, batch):
    """DPO's sigmoid loss of one pair, backward included; returns the loss."""
    import torch
    import torch.nn.functional as F

    sums = policy_logps(batch)
    with torch.no_grad():
        ref = reference_logps(batch)
    loss = -F.logsigmoid(DPO_BETA * ((sums[0] - ref[0]) - (sums[1] - ref[1])))
    loss.backward()
    return loss


def grpo_step(policy_logps, reference_logps, batch, beta: float):
    """GRPO's learner step on a group of 2 (advantages +1, -1): dapo, the rollout's own policy; with
    ``beta > 0`` the KL to the reference's log-probs (``reference_logps``; None: no reference at all)."""
    import torch

    from qwenkit.config import GrpoConfig
    from qwenkit.model.losses.policy import GrpoLoss, StepTotals
    from qwenkit.model.losses.cross_entropy import IGNORE_INDEX, shift_labels

    logps = policy_logps(batch)  # [2, S]
    ref = None
    if beta > 0:
        with torch.no_grad():
            ref = reference_logps(batch)
    mask = shift_labels(batch["labels"]) != IGNORE_INDEX
    advantages = torch.tensor([1.0, -1.0], device=logps.device)
    loss = GrpoLoss(GrpoConfig(beta=beta))(logps, advantages, mask, StepTotals(2, mask.sum(), 1), ref=ref).loss
    loss.backward()
    return loss


def make_qwen3_config(shapes: dict):
    """A Qwen3-VL config of the same text sizes (``--family qwen3_vl``): 16-px patches, a learned
    48x48 position grid, DeepStack from vision block 0, interleaved mRoPE of the same section."""
    from transformers import Qwen3VLConfig

    base = make_config(shapes)
    text, vision = base.text_config.to_dict(), shapes["vision"]
    text.update(head_dim=text["hidden_size"] // text["num_attention_heads"],
                rope_scaling={"rope_type": "default", "mrope_section": shapes["text"]["mrope_section"],
                              "mrope_interleaved": True})  # fmt: skip
    vision = dict(depth=vision["depth"], hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
                  num_heads=vision["num_heads"], patch_size=16, num_position_embeddings=48 * 48,
                  deepstack_visual_indexes=[0], out_hidden_size=text["hidden_size"])  # fmt: skip
    ids = {k: getattr(base, f"{k}_token_id") for k in ("image", "video", "vision_start", "vision_end")}
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=shapes["tie"],
                         **{f"{k}_token_id": v for k, v in ids.items()})  # fmt: skip


QWEN3_5_VOCAB = 248_320  # Qwen3.5's vocabulary: the chunked head's ratios are measured at it


def make_qwen3_5_config(shapes: dict):
    """A Qwen3.5 config of the same text sizes (``--family qwen3_5``) at Qwen3.5's 248,320 vocabulary:
    layers in the checkpoints' pattern (every 4th full attention, the others Gated DeltaNet with half
    as many key heads as value heads, head dim 128 as in the 9B), partial rotary (a quarter of
    head_dim), Qwen3-VL's tower without DeepStack."""
    from transformers import Qwen3_5Config

    base = make_config(shapes, vocab=QWEN3_5_VOCAB)
    text = base.text_config.to_dict()
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    head_dim = hidden // text["num_attention_heads"]
    half = head_dim // 4 // 2  # rotary dims / 2
    value_heads = max(2, hidden // 128)
    text = {k: text[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}  # fmt: skip
    text.update(head_dim=head_dim, linear_num_value_heads=value_heads, linear_num_key_heads=value_heads // 2,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                # every 4th full attention, and the last layer (a 2-layer smoke config still has one)
                layer_types=["full_attention" if i % 4 == 3 or i == layers - 1 else "linear_attention" for i in range(layers)],
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [half - 2 * (half // 3), half // 3, half // 3], "mrope_interleaved": True})  # fmt: skip
    vision = shapes["vision"]
    vision = dict(depth=vision["depth"], hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
                  num_heads=vision["num_heads"], patch_size=16, num_position_embeddings=48 * 48,
                  out_hidden_size=hidden)  # fmt: skip
    ids = {k: getattr(base, f"{k}_token_id") for k in ("image", "video", "vision_start", "vision_end")}
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=shapes["tie"],
                         **{f"{k}_token_id": v for k, v in ids.items()})  # fmt: skip


# --family: the config of those shapes
CONFIGS = {"qwen2_5_vl": make_config, "qwen3_vl": make_qwen3_config, "qwen3_5": make_qwen3_5_config}


def timed_steps(forward_backward, opt, device, warmup: int, steps: int) -> tuple[float, list[float]]:
    """``warmup + steps`` optimizer steps (``forward_backward()`` returns the loss, its backward
    done): the median seconds of the timed ones and every step's loss. The SFT and DPO workers' one loop."""
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
    if args.variant in DPO_VARIANTS + GRPO_VARIANTS:
        return dpo_worker(args, config, shapes, device, dtype)
    if args.variant in ROLLOUT_VARIANTS:
        return rollout_worker(args, config, shapes, device, dtype)
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


def dpo_worker(args, config, shapes, device, dtype) -> dict:
    """One DPO variant's steps (see the module docstring); peak memory and median time."""
    import copy

    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from qwenkit.device import memory_bytes, reset_peak_memory
    from qwenkit.model.losses.logps import full_sequence_logps, full_token_logps
    from qwenkit.model.families.qwen2_5_vl import QwenkitQwen2_5_VL

    batch = pair_batch(config, shapes["seq"], shapes["image_side"], device)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    grpo = args.objective == "grpo"  # per-token log-probs and GRPO's step; else per-sequence sums and DPO's
    full_logps = full_token_logps if grpo else full_sequence_logps
    if args.variant in ("dpo-hf", "grpo-hf"):
        model = Qwen2_5_VLForConditionalGeneration(config).to(device=device, dtype=dtype).train()
        reference = copy.deepcopy(model).requires_grad_(False).eval() if not grpo or args.beta > 0 else None

        def logps(m):
            return lambda b: full_logps(m(**inputs).logits, b["labels"])[0]  # TRL: log_softmax, gather

        policy_logps, reference_logps = logps(model), logps(reference)
    else:
        model = QwenkitQwen2_5_VL(config).configure_loss(chunk=True, chunk_size="auto").to(device=device, dtype=dtype)
        model.lm_head.skip_ignored = True
        model.train()

        def policy_logps(b):
            return model.token_logps(**b)[0] if grpo else model.sequence_logps(**b)[0]

        if args.variant in ("dpo-lora", "grpo-lora"):
            from qwenkit import config as qconfig
            from qwenkit.model import lora

            lora.apply(model, qconfig.load(overrides=["lora.r=16", "lora.alpha=32"]).lora, seed=0)

            def reference_logps(b):
                with lora.adapters_disabled(model):
                    return model.token_logps(**b)[0] if grpo else model.sequence_logps(**b)[0]
        elif args.variant == "dpo-precompute":  # dpo.precompute_ref: the start's log-probs, once, before training
            with torch.no_grad():
                fixed = model.sequence_logps(**batch)[0]

            def reference_logps(b):
                return fixed
        elif grpo and args.beta == 0:  # no reference is built (grpo.beta: 0)
            reference_logps = None
        else:
            reference = copy.deepcopy(model).requires_grad_(False).eval()

            def reference_logps(b):
                return reference.token_logps(**b)[0] if grpo else reference.sequence_logps(**b)[0]

    fused = args.variant not in ("dpo-hf", "grpo-hf")
    step = functools.partial(grpo_step, beta=args.beta) if grpo else dpo_step
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=fused or None)
    reset_peak_memory(device)
    step_s, losses = timed_steps(lambda: step(policy_logps, reference_logps, batch), opt, device,
                                 args.warmup, args.steps)  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    peak = memory_bytes(device, peak=True)  # the learner step's, before a rollout is timed
    return {
        "variant": args.variant, "step_s": step_s, "peak_bytes": peak,
        "params": n_params, "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "losses": losses, "tokens": 2 * shapes["seq"], "optimizer": "AdamW fused" if fused else "AdamW foreach",
    }  # fmt: skip


def rollout_worker(args, config, shapes, device, dtype) -> dict:
    """One rollout variant (see the module docstring) on the model FSDP2-sharded in a one-rank group."""
    import torch
    import torch.distributed as dist

    from qwenkit import config as qconfig
    from qwenkit.bench.collectives import count_all_gathers
    from qwenkit.device import memory_bytes, reset_peak_memory
    from qwenkit.distributed import fsdp
    from qwenkit.engine.generation.generate import Sampling, generation_config, left_pad
    from qwenkit.engine.generation.placement import lockstep
    from qwenkit.engine.rollouts.hf import HfRollouts
    from qwenkit.model.families.qwen2_5_vl import QwenkitQwen2_5_VL

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = QwenkitQwen2_5_VL(config).configure_loss(chunk=True, chunk_size="auto").to(device=device, dtype=dtype)
    runtime = fsdp.Runtime(0, 1, 0, device, "gloo", False)
    fsdp.shard(model, qconfig.load().parallel, fsdp.build_mesh(runtime))
    batch = pair_batch(config, shapes["seq"], shapes["image_side"], device)
    prompt_len = int((batch["labels"][0] == -100).sum())
    new = batch["input_ids"].shape[1] - prompt_len
    prompt = {k: batch[k][:1, :prompt_len] for k in ("input_ids", "attention_mask", "mm_token_type_ids") if k in batch}
    grid = batch["image_grid_thw"][:1]
    prompt |= {"pixel_values": batch["pixel_values"][: int(grid.prod())], "image_grid_thw": grid}
    prompts = args.lockstep_prompts if args.variant == "rollout-lockstep" else args.rollout_prompts[0]
    end = 0  # suppressed: every completion runs to its full length
    reset_peak_memory(device)
    with count_all_gathers() as gathers:
        t0 = time.perf_counter()
        if args.variant == "rollout-lockstep":  # one generate call per prompt's group, HF sampling
            generation = generation_config(Sampling(new, temperature=1.0), eos_token_id=end, pad_token_id=end)
            generation.suppress_tokens = [end]
            model.eval()
            with torch.no_grad(), lockstep(model) as step:
                for p in range(prompts):
                    torch.manual_seed(p)
                    step(left_pad([prompt] * 2, end), generation)
        else:
            cast = torch.bfloat16 if args.variant == "rollout-bf16" else None
            rollouts = HfRollouts(Sampling(new, temperature=1.0), 2, where="gather", dtype=cast)
            rollouts.sample_rows(model, [prompt] * (2 * prompts), list(range(2 * prompts)), end, end, [end])
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    element = next(model.parameters()).element_size()
    return {"variant": args.variant, "rollout_s": seconds, "prompts": prompts, "completions": 2 * prompts, "new": new,
            "all_gathers": len(gathers), "gathered_bytes": sum(gathers) * element,
            "peak_bytes": memory_bytes(device, peak=True)}  # fmt: skip


def dpo_main(args) -> int:
    """``--objective dpo`` or ``grpo``: the two-row steps of the module docstring, each against its full-logits step."""
    grpo = args.objective == "grpo"
    variants = args.variants or list(GRPO_VARIANTS + ROLLOUT_VARIANTS if grpo else DPO_VARIANTS)
    rollout_rows = [_spawn(args, v, p) for v in variants if v in ROLLOUT_VARIANTS
                    for p in (args.rollout_prompts if v != "rollout-lockstep" else [None])]  # fmt: skip
    variants = [v for v in variants if v not in ROLLOUT_VARIANTS]
    what = f"GRPO learner step (grpo.beta {args.beta}), two completions" if grpo else "DPO step, one pair"
    print(f"{what} of 2 x {SHAPES[args.shapes]['seq']} tokens sharing an image prompt; "
          f"shapes={args.shapes} vocab={VOCAB:,} device={args.device}")  # fmt: skip
    rows = [_spawn(args, v) for v in variants]
    base = next((r for r in rows if r["variant"] in ("dpo-hf", "grpo-hf")), rows[0]) if rows else None
    if rows:
        _learner_table(rows, base)
    learner = next((r for r in rows if r["variant"] == "grpo"), None)
    if rollout_rows:
        _rollout_table(rollout_rows, learner)
    if args.out:
        from qwenkit.notebooks.results import write_jsonl

        write_jsonl(rows + rollout_rows, args.out)
    return 0


def _rollout_table(rows: list[dict], learner: dict | None) -> None:
    """The rollout variants against ``rollout-lockstep``, and each one's share of a step of its prompts."""
    base = next((r for r in rows if r["variant"] == "rollout-lockstep"), rows[0])
    print(f"\n{'rollout':<18}{'prompts':>8}{'tokens':>8}{'s':>9}{'tok/s':>8}{'x lockstep':>11}{'all-gathers':>12}"
          f"{'GiB gathered':>13}{'peak GiB':>9}{'share':>7}")  # fmt: skip
    for r in rows:
        tokens = r["completions"] * r["new"]
        r["tokens_per_s"] = tokens / r["rollout_s"]
        r["speedup"] = r["tokens_per_s"] / (base["completions"] * base["new"] / base["rollout_s"])
        # a step of P prompts: their rollout, then P learner micro-batches of one group (the grpo variant's step)
        r["share"] = r["rollout_s"] / (r["rollout_s"] + r["prompts"] * learner["step_s"]) if learner else None
        share = f"{r['share']:>7.0%}" if learner else f"{'':>7}"
        print(f"{r['variant']:<18}{r['prompts']:>8}{tokens:>8}{r['rollout_s']:>9.2f}{r['tokens_per_s']:>8.1f}"
              f"{r['speedup']:>11.2f}{r['all_gathers']:>12}{r['gathered_bytes'] / GiB:>13.2f}{r['peak_bytes'] / GiB:>9.2f}{share}")  # fmt: skip
    if learner:
        print(f"share: the rollout over the rollout plus `prompts` learner micro-batches of {learner['step_s']:.2f} s "
              "(the grpo variant's step); targets: rollout share <= 35%, tok/s >= 4x lockstep")  # fmt: skip


def _learner_table(rows: list[dict], base: dict) -> None:
    print(f"\n{'variant':<10}{'optimizer':>15}{'step s':>8}{'peak GiB':>10}{'time/HF':>9}{'mem/HF':>8}{'trainable':>13}"
          f"{'first loss':>12}")  # fmt: skip
    targets = {"dpo": "peak <= 0.50x, time <= 0.80x", "dpo-precompute": "peak <= 0.50x, time <= 0.80x",
               "dpo-lora": "peak <= 0.35x", "grpo": "peak <= 0.50x", "grpo-lora": "peak <= 0.50x"}
    for r in rows:
        r["time_ratio"], r["mem_ratio"] = r["step_s"] / base["step_s"], r["peak_bytes"] / base["peak_bytes"]
        print(f"{r['variant']:<10}{r['optimizer']:>15}{r['step_s']:>8.2f}{r['peak_bytes'] / GiB:>10.2f}"
              f"{r['time_ratio']:>9.2f}{r['mem_ratio']:>8.2f}{r['trainable']:>13,}{r['losses'][0]:>12.5f}"
              f"{'   target ' + targets[r['variant']] if r['variant'] in targets else ''}")  # fmt: skip



def _mfu_cell(value: float | None, width: int) -> str:
    return f"{value:>{width}.2f}" if value is not None else f"{'error':>{width}}"


def _spawn(args, variant: str, rollout_prompts: int | None = None) -> dict:
    cmd = [__file__, "--worker", "--variant", variant, "--device", args.device,
           "--shapes", args.shapes, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--gemm-size", str(args.gemm_size), "--objective", args.objective, "--family", args.family, "--beta", str(args.beta),
           "--rollout-prompts", str(rollout_prompts or args.rollout_prompts[0]), "--lockstep-prompts", str(args.lockstep_prompts)]  # fmt: skip
    return fresh_process(cmd, f"variant {variant}")  # the same allocator for every variant


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shapes", default=None, choices=list(SHAPES),
                   help="default: cpu on CPU, 3b on CUDA; tiny: a seconds-long smoke check")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gemm-size", type=int, default=4096, help="side of the square GEMM the MFU peak is measured with")
    p.add_argument("--objective", default="sft", choices=["sft", "dpo", "grpo"],
                   help="dpo: one preference pair, DPO's step; grpo: two completions, GRPO's learner step")
    p.add_argument("--beta", type=float, default=None,
                   help="grpo: the KL weight of every variant (default: grpo.beta's default; 0 builds no reference)")
    p.add_argument("--variants", nargs="+", default=None)
    p.add_argument("--rollout-prompts", type=int, nargs="+", default=[4],
                   help="grpo: prompts (x 2 completions) of the rollout variant; several: one process each")
    p.add_argument("--lockstep-prompts", type=int, default=1,
                   help="grpo: prompts of rollout-lockstep (one generate call each: its tokens/s do not depend on it)")
    p.add_argument("--family", default="qwen2_5_vl", choices=list(CONFIGS), help="the model family (model.name)")
    p.add_argument("--out", default=None, help="also write the results as JSON lines here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="hf", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.shapes = args.shapes or ("3b" if args.device == "cuda" else "cpu")
    if args.beta is None:
        from qwenkit.config import GrpoConfig

        args.beta = GrpoConfig().beta
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: --device cuda but no CUDA device is available")
        return 0
    if args.objective in ("dpo", "grpo"):
        if args.family != "qwen2_5_vl":  # the pair batch and the steps are written for Qwen2.5-VL
            p.error(f"--objective {args.objective} measures Qwen2.5-VL, not --family {args.family}")
        return dpo_main(args)
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
    rows = [_spawn(args, v) for v in variants]
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
