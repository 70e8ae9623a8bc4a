"""Per-rank parameter + optimizer memory under FSDP2: 2 gloo ranks vs 1, on a ~20M-parameter Qwen2.5-VL.

Each world size runs in fresh processes: the model (a wider tiny config, random weights) is
sharded with qwenkit's default plan, takes one AdamW step on an image+text batch (so every
parameter has a gradient and AdamW state), and each rank counts the bytes of what it holds:
its parameter shards, gradient shards and optimizer state. FSDP2 shards every tensor on dim 0,
so with 2 ranks each should hold about half (a little more where a dim 0 is odd and padded).
Then LoRA (r = 16, every linear of the language model, :func:`qwenkit.model.lora.apply` before
``fully_shard``) at 2 ranks beside the full fine-tune: the frozen base keeps its parameter shards,
but only the adapters have gradients and AdamW state.

    python benchmarks/fsdp_memory.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.multiprocessing as mp
from synthetic import make_batch, make_config
from torch.distributed.tensor import DTensor

from qwenkit.launch import free_port
from qwenkit.torchrun import rank_env

MiB = 2**20
VOCAB = 8192
IDS = {"image": VOCAB - 4, "video": VOCAB - 3, "vision_start": VOCAB - 2, "vision_end": VOCAB - 1}
# the tiny architecture widened to ~20M parameters (real vocab and depth would not fit 2 CPU cores)
SHAPES = dict(
    text=dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
              num_key_value_heads=2, mrope_section=[8, 12, 12]),  # sums to head_dim / 2 = 32
    vision=dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, window_size=56,
                fullatt_block_indexes=[3]),
)  # fmt: skip
TOKENS = dict(bos_token_id=VOCAB - 8, eos_token_id=VOCAB - 7, pad_token_id=VOCAB - 8)
# one sample: 24 text tokens, a 56x56 image (4x4 patches -> 4 image tokens and 2 marks), 24 text tokens
INPUTS = dict(seq=54, image_side=56)


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _rank(rank: int, world: int, port: int, results, use_lora: bool = False) -> None:
    from qwenkit import config as qconfig
    from qwenkit.distributed import fsdp
    from qwenkit.model.families.qwen2_5_vl import QwenkitQwen2_5_VL

    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    cfg = qconfig.load(overrides=["parallel.device=cpu", "lora.r=16", "lora.alpha=32"])
    rt = fsdp.init_distributed(cfg.parallel)
    torch.manual_seed(0)
    model = QwenkitQwen2_5_VL(make_config(SHAPES, VOCAB, IDS, max_positions=4096, **TOKENS)).configure_loss(chunk=True)
    if use_lora:
        from qwenkit.model import lora

        lora.apply(model, cfg.lora, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    fsdp.shard(model, cfg.parallel, fsdp.build_mesh(rt))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model(**make_batch(model.config, **INPUTS)).loss.backward()
    optimizer.step()
    held = {
        "params": sum(_bytes(p) for p in model.parameters()),
        "grads": sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None),
        "optimizer": sum(_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
    }
    results.put((world, rank, n_params, held))
    fsdp.shutdown(rt)


def measure(world: int, use_lora: bool = False) -> list[tuple]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, free_port(), results, use_lora), nprocs=world, start_method="spawn")
    return sorted(results.get() for _ in range(world))


def main() -> int:
    rows = measure(1) + measure(2)
    n_params = rows[0][2]
    print(f"Qwen2.5-VL, widened tiny config: {n_params / 1e6:.1f}M parameters, fp32, AdamW, FSDP2 on gloo")
    print(f"{'world':>5} {'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'optimizer MiB':>14} {'params+optim MiB':>17}")
    for world, rank, _, held in rows:
        print(
            f"{world:>5} {rank:>4} {held['params'] / MiB:>11.2f} {held['grads'] / MiB:>10.2f} "
            f"{held['optimizer'] / MiB:>14.2f} {(held['params'] + held['optimizer']) / MiB:>17.2f}"
        )
    one = rows[0][3]["params"] + rows[0][3]["optimizer"]
    for _, rank, _, held in rows[1:]:
        ratio = (held["params"] + held["optimizer"]) / one
        print(f"rank {rank} of 2 / single process, params+optimizer: {ratio:.3f}x (ideal 0.5)")
    full, lora_rows = rows[1:], measure(2, use_lora=True)
    print("\n2 ranks, full fine-tune vs LoRA (r=16, all-linear), per rank:")
    print(f"{'run':>5} {'rank':>4} {'params MiB':>11} {'grads MiB':>10} {'optimizer MiB':>14} {'grads+optim MiB':>16}")
    for name, group in (("full", full), ("lora", lora_rows)):
        for _, rank, _, held in group:
            print(f"{name:>5} {rank:>4} {held['params'] / MiB:>11.2f} {held['grads'] / MiB:>10.2f} "
                  f"{held['optimizer'] / MiB:>14.2f} {(held['grads'] + held['optimizer']) / MiB:>16.2f}")
    for (_, rank, _, f), (_, _, _, lo) in zip(full, lora_rows):
        ratio = (lo["grads"] + lo["optimizer"]) / (f["grads"] + f["optimizer"])
        total = (lo["params"] + lo["grads"] + lo["optimizer"]) / (f["params"] + f["grads"] + f["optimizer"])
        print(f"rank {rank}: LoRA / full, grads+optimizer {ratio:.4f}x (target <= 0.05); params+grads+optimizer {total:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
