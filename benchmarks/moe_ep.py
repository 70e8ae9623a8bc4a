"""Expert parallelism vs FSDP-only: per-rank expert bytes and bytes sent per step, one MoE layer.

One Qwen3-VL-MoE sparse block (HF's ``Qwen3VLMoeTextSparseMoeBlock``: router + fused experts)
on ``--ranks`` gloo ranks, sharded as qwenkit shards a decoder layer (``fsdp.shard``), two variants
in fresh processes each:

- ``fsdp``: ``ep_size=1``, the experts sharded like any weight: every rank all-gathers all E
  experts for the forward (again for the backward: ``reshard_after_forward``) and reduce-scatters
  their gradients;
- ``ep``: ``ep_size=--ranks`` (``qwenkit.distributed.expert``): each rank holds E/ep whole experts,
  tokens travel by all-to-all (dispatch + combine, forward and backward); with ``--ranks`` >
  ``--ep`` the local experts are FSDP-sharded over the remaining ranks.

Per rank, after one warm-up step: the experts' bytes the rank keeps (sharded) and holds at once in
the forward (gathered: measured by a pre-forward hook on the experts module); the bytes it sends per
step by collective (FSDP's all-gather and reduce-scatter, the all-to-alls; counted by wrapping
``torch.distributed``'s functions, a ring's ``(n-1)/n`` of the gathered or scattered tensor, an
all-to-all's rows for other ranks); the step time (CPU gloo: as measured, not the cost model of
NVLink). The model's expectations are printed beside (``expected``).

    python benchmarks/moe_ep.py --shape tiny        # seconds
    python benchmarks/moe_ep.py --shape a30b        # one Qwen3-VL-30B-A3B layer (128 experts): ~10 GB, minutes on CPU

The rows go to ``benchmarks/results/moe_ep_<shape>.jsonl`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf_moe

from qwenkit import config as qconfig
from qwenkit.distributed import expert, fsdp
from qwenkit.launch import free_port
from qwenkit.torchrun import rank_env

MiB = 2**20
SHAPES = {  # Qwen3-VL-MoE text shapes: hidden, expert intermediate, experts, top-k, tokens per rank, dtype
    "tiny": dict(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, tokens=256, dtype="float32"),
    "a30b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, tokens=1024,
                 dtype="bfloat16"),
}  # fmt: skip


class Layer(nn.Module):
    """The MoE block where a decoder layer holds it (``mlp``), so the experts' path is ``mlp.experts``."""

    def __init__(self, cfg):
        super().__init__()
        self.mlp = hf_moe.Qwen3VLMoeTextSparseMoeBlock(cfg)

    def forward(self, x):
        return self.mlp(x)


def _count(sent: collections.Counter, name: str, original):
    def wrapped(*args, **kwargs):
        group = kwargs.get("group")
        n, me = dist.get_world_size(group), dist.get_rank(group)
        if name == "all_to_all_single":
            inp = args[1]
            in_sizes = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
            row = inp[0].numel() * inp.element_size() if inp.shape[0] else 0
            sent[name] += (sum(in_sizes) - in_sizes[me]) * row if in_sizes else inp.numel() * inp.element_size() * (n - 1) // n
        elif name == "all_gather_single":  # ring: (n-1)/n of the gathered output leaves each rank
            big = kwargs.get("output_tensor", args[0] if args else None)
            sent[name] += big.numel() * big.element_size() * (n - 1) // n
        else:  # reduce_scatter_single, FSDP passes keywords: (n-1)/n of the scattered input
            big = kwargs["input"]
            sent[name] += big.numel() * big.element_size() * (n - 1) // n
        return original(*args, **kwargs)

    return wrapped


def _rank(rank: int, world: int, port: int, shape: str, ep: int, out: str) -> None:
    os.environ.update(rank_env(rank, world, port))
    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # the layer's output: not modified in place
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    s = SHAPES[shape]
    dtype = getattr(torch, s["dtype"])
    cfg = hf_moe.Qwen3VLMoeTextConfig(**{k: s[k] for k in ("hidden_size", "moe_intermediate_size", "num_experts",
                                                             "num_experts_per_tok")}, hidden_act="silu")  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Layer(cfg).to(dtype)
    parallel = qconfig.load(overrides=["parallel.shard_patterns=[mlp]"]).parallel
    rt = fsdp.Runtime(rank, world, rank, torch.device("cpu"), "gloo", False)
    experts = expert.apply(model, ("mlp.experts",), expert.build_expert_mesh("cpu", world, ep)) if ep > 1 else None
    fsdp.shard(model, parallel, fsdp.build_mesh(rt), experts)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    block = model.mlp.experts
    held = {}
    block.register_forward_pre_hook(lambda m, a: held.update(gathered=sum(expert.local_weight(p).nbytes for p in m.parameters())))
    sharded = sum(p.to_local().nbytes for p in block.parameters())
    x = torch.randn(1, s["tokens"], s["hidden_size"], generator=torch.Generator().manual_seed(rank)).to(dtype)

    def step():
        model(x).float().square().mean().backward()

    step()  # warm-up: gradients exist, buffers allocated
    sent: collections.Counter = collections.Counter()
    originals = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single", "all_to_all_single")}
    for n, f in originals.items():
        setattr(dist, n, _count(sent, n, f))
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    seconds = time.perf_counter() - start
    for n, f in originals.items():
        setattr(dist, n, f)
    if rank == 0:
        row = {"shape": shape, "ranks": world, "ep_size": ep, "sharded_MiB": sharded / MiB,
               "gathered_MiB": held["gathered"] / MiB, "sent_MiB": {k: v / MiB for k, v in sent.items()},
               "step_s": seconds}  # fmt: skip
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def expected(shape: str, world: int, ep: int) -> dict:
    """The cost model: experts' bytes per rank and bytes sent per step (``reshard_after_forward``: 2 gathers;
    uniform routing: ``(ep-1)/ep`` of the (token, expert) rows go to other ranks, 4 exchanges of them)."""
    s = SHAPES[shape]
    size = torch.finfo(getattr(torch, s["dtype"])).bits // 8
    experts = s["num_experts"] * 3 * s["hidden_size"] * s["moe_intermediate_size"] * size  # gate_up + down
    local = experts / ep
    efsdp = world // ep
    ring = (efsdp - 1) / efsdp
    rows = s["tokens"] * s["num_experts_per_tok"] * s["hidden_size"] * size * (ep - 1) / ep  # to other ranks' experts
    return {"sharded_MiB": local / efsdp / MiB, "gathered_MiB": local / MiB,
            "all_gather_MiB": 2 * ring * local / MiB, "reduce_scatter_MiB": ring * local / MiB,
            "all_to_all_MiB": 4 * rows / MiB}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="tiny")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--ep", type=int, default=0, help="ep_size of the EP variant (0: --ranks)")
    ap.add_argument("--out", default=None, help="the rows' JSON-lines file (default: benchmarks/results/moe_ep_<shape>.jsonl)")
    ap.add_argument("--expected-only", action="store_true", help="print the cost model, run nothing")
    args = ap.parse_args()
    ep = args.ep or args.ranks
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"moe_ep_{args.shape}.jsonl")
    if args.expected_only:
        for size in (1, ep):
            print(f"{args.shape} ranks={args.ranks} ep_size={size}:", json.dumps({k: round(v, 2) for k, v in expected(args.shape, args.ranks, size).items()}))
        return 0
    if os.path.exists(out):
        os.remove(out)
    for size in (1, ep):
        mp.start_processes(_rank, args=(args.ranks, free_port(), args.shape, size, out), nprocs=args.ranks,
                           start_method="spawn")  # fmt: skip
    rows = [json.loads(line) for line in open(out)]
    print(f"{args.shape}: one MoE layer on {args.ranks} gloo ranks, per rank ({torch.__version__}, {sys.platform})")
    print(f"{'variant':10} {'kept MiB':>9} {'gathered':>9} {'all-gather':>11} {'red-scat':>9} {'all-to-all':>11} {'step s':>7}")
    for row in rows:
        sent = row["sent_MiB"]
        name = "fsdp" if row["ep_size"] == 1 else f"ep {row['ep_size']}"
        print(f"{name:10} {row['sharded_MiB']:9.2f} {row['gathered_MiB']:9.2f} {sent.get('all_gather_single', 0):11.2f} "
              f"{sent.get('reduce_scatter_single', 0):9.2f} {sent.get('all_to_all_single', 0):11.2f} {row['step_s']:7.3f}")  # fmt: skip
        want = expected(args.shape, args.ranks, row["ep_size"])
        print(f"{'  expected':10} {want['sharded_MiB']:9.2f} {want['gathered_MiB']:9.2f} {want['all_gather_MiB']:11.2f} "
              f"{want['reduce_scatter_MiB']:9.2f} {want['all_to_all_MiB']:11.2f}")  # fmt: skip
    fsdp_row, ep_row = rows
    print(f"gathered experts, ep / fsdp: {ep_row['gathered_MiB'] / fsdp_row['gathered_MiB']:.3f} (target 1/ep_size = {1 / ep:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
