"""DPO's and GRPO's training steps against their full-logits steps, and GRPO's rollouts.

The shapes, the allocator setting and the optimizers are ``benchmarks/train_step.py``'s (SFT's step).

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

``grpo-padded`` and ``grpo-packed`` (``--variants``, not run by default): the ``grpo`` step on a ragged
group, the second completion ended at a quarter of its length (as completions that stop early): right-padded
to the longest row (``data.packing: false``) or packed into one row (``data.packing: true``), the same real
tokens; each prints its padding fraction beside its step time.

    python benchmarks/dpo_grpo_step.py --objective dpo       # one pair of 2 x 2,048 tokens sharing an image prompt
    python benchmarks/dpo_grpo_step.py --objective grpo      # GRPO's learner step on two completions of 2,048 tokens
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

from synthetic import QWEN_ORDINARY, SHAPES, VOCAB, make_batch, make_config
from timing import GiB, device_missing, parse, spawn, step_arguments, timed_steps

DPO_VARIANTS = ("dpo-hf", "dpo", "dpo-precompute", "dpo-lora")
DPO_BETA = 0.1
GRPO_VARIANTS = ("grpo-hf", "grpo", "grpo-lora")
PACKING_VARIANTS = ("grpo-padded", "grpo-packed")  # a ragged group, padded or packed (data.packing)
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


def ragged_batch(batch: dict, packed: bool) -> dict:
    """``batch``'s two rows, the second's completion ended at a quarter of its length: right-padded (pad id 0,
    no label, attention mask 0) or packed into one row (:func:`qwenkit.data.collator.pack`), the media as they were."""
    from qwenkit.data.collator import SEQUENCE_KEYS, pack
    from qwenkit.model.losses.cross_entropy import IGNORE_INDEX

    prompt = int((batch["labels"][1] == -100).sum())
    keep = prompt + (batch["input_ids"].shape[1] - prompt) // 4
    if packed:
        rows = [{k: batch[k][r, : (keep if r else None)] for k in SEQUENCE_KEYS} for r in (0, 1)]
        return pack(rows) | {k: batch[k] for k in ("pixel_values", "image_grid_thw")}
    out = {k: v.clone() for k, v in batch.items()}
    for key, value in (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE_INDEX), ("mm_token_type_ids", 0)):
        out[key][1, keep:] = value
    return out


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
    from qwenkit.engine.rollouts.completion import completion_mask
    from qwenkit.model.losses.policy import GrpoLoss, StepTotals

    logps = policy_logps(batch)  # [2, S]
    ref = None
    if beta > 0:
        with torch.no_grad():
            ref = reference_logps(batch)
    mask = completion_mask(batch)  # [2, S] the padded layout, packed or not
    advantages = torch.tensor([1.0, -1.0], device=logps.device)
    loss = GrpoLoss(GrpoConfig(beta=beta))(logps, advantages, mask, StepTotals(2, mask.sum(), 1), ref=ref).loss
    loss.backward()
    return loss


def worker(args) -> dict:
    import torch

    shapes = SHAPES[args.shapes]
    device = torch.device(args.device)
    dtype = getattr(torch, shapes["dtype"])
    config = make_config(shapes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    if args.variant in ROLLOUT_VARIANTS:
        return rollout_worker(args, config, shapes, device, dtype)
    return learner_worker(args, config, shapes, device, dtype)


def learner_worker(args, config, shapes, device, dtype) -> dict:
    """One DPO or GRPO learner variant's steps (see the module docstring); peak memory and median time."""
    import copy

    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from qwenkit.device import memory_bytes, reset_peak_memory
    from qwenkit.model.families.qwen2_5_vl import QwenkitQwen2_5_VL
    from qwenkit.model.losses.logps import full_sequence_logps, full_token_logps

    batch = pair_batch(config, shapes["seq"], shapes["image_side"], device)
    if args.variant in PACKING_VARIANTS:
        batch = ragged_batch(batch, packed=args.variant == "grpo-packed")
    positions = batch["input_ids"].numel()
    tokens = int(batch["attention_mask"].sum()) if "attention_mask" in batch else positions
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
        "losses": losses, "tokens": tokens, "padding_fraction": 1 - tokens / positions,
        "optimizer": "AdamW fused" if fused else "AdamW foreach",
    }  # fmt: skip


def rollout_worker(args, config, shapes, device, dtype) -> dict:
    """One rollout variant (see the module docstring) on the model FSDP2-sharded in a one-rank group."""
    import torch
    import torch.distributed as dist

    from qwenkit import config as qconfig
    from qwenkit.bench.collectives import count_all_gathers
    from qwenkit.device import memory_bytes, reset_peak_memory
    from qwenkit.distributed import fsdp
    from qwenkit.engine.generation.generate import generation_config, left_pad
    from qwenkit.engine.generation.placement import lockstep
    from qwenkit.engine.generation.sampling import Sampling
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


def run(args) -> int:
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
    print(f"\n{'variant':<12}{'optimizer':>15}{'tokens':>8}{'padding':>8}{'step s':>8}{'peak GiB':>10}{'time/HF':>9}"
          f"{'mem/HF':>8}{'trainable':>13}{'first loss':>12}")  # fmt: skip
    targets = {"dpo": "peak <= 0.50x, time <= 0.80x", "dpo-precompute": "peak <= 0.50x, time <= 0.80x",
               "dpo-lora": "peak <= 0.35x", "grpo": "peak <= 0.50x", "grpo-lora": "peak <= 0.50x"}
    for r in rows:
        r["time_ratio"], r["mem_ratio"] = r["step_s"] / base["step_s"], r["peak_bytes"] / base["peak_bytes"]
        print(f"{r['variant']:<12}{r['optimizer']:>15}{r['tokens']:>8}{r['padding_fraction']:>8.1%}{r['step_s']:>8.2f}"
              f"{r['peak_bytes'] / GiB:>10.2f}"
              f"{r['time_ratio']:>9.2f}{r['mem_ratio']:>8.2f}{r['trainable']:>13,}{r['losses'][0]:>12.5f}"
              f"{'   target ' + targets[r['variant']] if r['variant'] in targets else ''}")  # fmt: skip


def _spawn(args, variant: str, rollout_prompts: int | None = None) -> dict:
    return spawn(__file__, args, variant, "--objective", args.objective, "--beta", str(args.beta),
                 "--rollout-prompts", str(rollout_prompts or args.rollout_prompts[0]),
                 "--lockstep-prompts", str(args.lockstep_prompts))  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step_arguments(p, list(SHAPES))
    p.add_argument("--objective", required=True, choices=["dpo", "grpo"],
                   help="dpo: one preference pair, DPO's step; grpo: two completions, GRPO's learner step and its rollouts")
    p.add_argument("--beta", type=float, default=None,
                   help="grpo: the KL weight of every variant (default: grpo.beta's default; 0 builds no reference)")
    p.add_argument("--rollout-prompts", type=int, nargs="+", default=[4],
                   help="grpo: prompts (x 2 completions) of the rollout variant; several: one process each")
    p.add_argument("--lockstep-prompts", type=int, default=1,
                   help="grpo: prompts of rollout-lockstep (one generate call each: its tokens/s do not depend on it)")
    p.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_5_vl"],
                   help="the pair batch and the steps are written for Qwen2.5-VL")
    args = parse(p, argv)
    if args.beta is None:
        from qwenkit.config import GrpoConfig

        args.beta = GrpoConfig().beta
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if device_missing(args):
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
