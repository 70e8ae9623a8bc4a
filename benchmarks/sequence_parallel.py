"""Ulysses sequence parallelism: per-rank activation memory and step time at sp_size 1 and 2.

One long video-like sample (a short prompt, a video of ``--frames`` temporal patches of
``--side`` px, a reply; >= 16k tokens at the default size, most of them video) on a Qwen2.5-VL
with the text-1024 x 4-layer shape, on 2 ranks:

- ``sp_size=1``: each rank runs the whole sample (data parallelism's per-rank cost of one sample);
- ``sp_size=2``: the two ranks split it (qwenkit.distributed.sequence): half the tokens each,
  half the temporal patches through the vision tower each, attention by all-to-all.

Each variant runs in fresh processes: one warm-up step (so gradients exist), then a measured
forward + backward. Per rank: the activation peak (peak memory of the step above what the rank
held before it: weights, gradients, the batch), the step time, and the vision share measured
alone (the tower's forward + backward on this rank's frames). The losses of the two variants
must be equal (the SP group's slice losses sum to the whole loss). CPU: peak RSS (VmHWM, reset
through /proc/self/clear_refs); CUDA: ``max_memory_allocated`` (needs 2 GPUs: one rank each).

    python benchmarks/sequence_parallel.py                 # full size (CPU: slow; GPU when 2 are present)
    python benchmarks/sequence_parallel.py --tiny          # a seconds-long check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp
from synthetic import make_config

from qwenkit.launch import free_port
from qwenkit.torchrun import rank_env

MiB = 2**20
VOCAB = 32_768
IDS = {"image": VOCAB - 4, "video": VOCAB - 3, "vision_start": VOCAB - 2, "vision_end": VOCAB - 1}
TOKENS = dict(bos_token_id=VOCAB - 8, eos_token_id=VOCAB - 7, pad_token_id=VOCAB - 8)
FULL = dict(
    text=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=2, mrope_section=[8, 12, 12]),  # head_dim 64: sums to 32
    vision=dict(depth=4, hidden_size=512, intermediate_size=1376, num_heads=8, fullatt_block_indexes=[3]),
    frames=60, side=448, text_tokens=1024,  # 60 x (32 x 32 / 4) = 15,360 video tokens + 1,026 text and marks
)  # fmt: skip
TINY = dict(
    text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, mrope_section=[2, 3, 3]),
    vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, window_size=56, fullatt_block_indexes=[1]),
    frames=8, side=56, text_tokens=32,
)  # fmt: skip


def video_sample(config, frames: int, side: int, text: int) -> dict:
    """One row: ``text/2`` prompt tokens, a video of ``frames`` temporal patches, ``text/2`` reply tokens (learned)."""
    vc = config.vision_config
    grid = side // vc.patch_size
    n_video = frames * grid * grid // vc.spatial_merge_size**2
    g = torch.Generator().manual_seed(0)
    prompt, reply = (
        torch.randint(0, VOCAB - 8, (text // 2,), generator=g),
        torch.randint(0, VOCAB - 8, (text // 2,), generator=g),
    )
    span = torch.tensor(
        [config.vision_start_token_id] + [config.video_token_id] * n_video + [config.vision_end_token_id]
    )
    ids = torch.cat([prompt, span, reply])[None]
    labels = torch.full_like(ids, -100)
    labels[0, -reply.numel() - 1 :] = ids[0, -reply.numel() - 1 :]  # the reply (and the end mark before it)
    return {
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
        "mm_token_type_ids": 2 * (ids == config.video_token_id).int(),
        "pixel_values_videos": torch.randn(frames * grid * grid, 3 * vc.temporal_patch_size * vc.patch_size**2,
                                           generator=g),
        "video_grid_thw": torch.tensor([[frames, grid, grid]]), "second_per_grid_ts": torch.tensor([1.0]),
    }  # fmt: skip


class Meter:
    """Peak memory above a baseline: CUDA allocator, or the process's peak RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / MiB
        return _status("VmRSS")

    def reset(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
        return self.now()

    def peak(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / MiB
        return _status("VmHWM")


class SavedBytes:
    """Bytes of the activations autograd keeps for backward during a forward (parameters excluded).

    Counted per tensor (address and size: a view saved twice counts once; a slice of the batch
    counts its own bytes, not its base's); device-independent, unlike a CPU process's peak RSS,
    which the allocator's reuse of freed memory blurs.
    """

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[tuple[int, int], int] = {}

    def __enter__(self):
        def pack(t):
            if t.untyped_storage().data_ptr() not in self.params:
                self.storages[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
            return t

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    @property
    def mib(self) -> float:
        return sum(self.storages.values()) / MiB


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _rank(rank: int, world: int, port: int, sp_size: int, shape_name: str, device_type: str, recompute: bool,
          sample: dict, results):  # fmt: skip
    import torch.distributed as dist

    from qwenkit.distributed import fsdp, sequence
    from qwenkit.model.families.qwen2_5_vl import QwenkitQwen2_5_VL

    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    device = torch.device("cpu") if device_type == "cpu" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    shapes = {**(FULL if shape_name == "full" else TINY), **sample}
    torch.manual_seed(0)
    config = make_config(shapes, VOCAB, IDS, max_positions=65_536, **TOKENS)
    model = QwenkitQwen2_5_VL(config).configure_loss(chunk=True).to(device)
    if recompute:
        fsdp.apply_recompute(model, "auto")  # the family's recompute units: the decoder layers
    sp = sequence.init_groups(rank, world, sp_size)
    if sp_size > 1:
        sequence.enable(model, sp)
    batch = {
        k: v.to(device)
        for k, v in video_sample(config, shapes["frames"], shapes["side"], shapes["text_tokens"]).items()
    }
    meter = Meter(device)

    model(**batch).loss.backward()  # warm-up: gradients allocated, kernels chosen
    base = meter.reset()
    began = time.perf_counter()
    with SavedBytes(model) as step_saved:
        loss = model(**batch).loss
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    step_time = time.perf_counter() - began
    step_peak = meter.peak() - base

    base = meter.reset()
    began = time.perf_counter()
    pixels, grid = batch["pixel_values_videos"], batch["video_grid_thw"]
    with SavedBytes(model) as vision_saved:
        if sp_size > 1:
            features = sequence.encode_share(model, pixels, grid, sp)[0][0]  # the merged features
        else:
            features = model.vision_tower(pixels, grid)[0]
    features.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    vision_time = time.perf_counter() - began
    vision_peak = meter.peak() - base

    total = loss.detach().clone()
    if sp_size > 1:
        dist.all_reduce(total, group=sp.group)
    results.put(dict(sp_size=sp_size, rank=rank, tokens=int(batch["input_ids"].shape[1]),
                     video_tokens=int((batch["input_ids"] == config.video_token_id).sum()),
                     loss=float(total), step_time=step_time, activation_peak_mib=step_peak, saved_mib=step_saved.mib,
                     vision_time=vision_time, vision_peak_mib=vision_peak, vision_saved_mib=vision_saved.mib))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def measure(sp_size: int, shape_name: str, device_type: str, recompute: bool, sample: dict, world: int = 2) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(world, free_port(), sp_size, shape_name, device_type, recompute, sample, results),
                       nprocs=world, start_method="spawn")  # fmt: skip
    return sorted((results.get() for _ in range(world)), key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy sizes: checks that the benchmark runs")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda with 2 GPUs, else cpu")  # fmt: skip
    p.add_argument("--no-recompute", action="store_true", help="keep every decoder layer's activations")
    p.add_argument("--frames", type=int, help="temporal patches of the video (default: the size's)")
    p.add_argument("--side", type=int, help="video side in px, a multiple of 28 (default: the size's)")
    p.add_argument("--json", help="write the rows to this JSONL file too")
    p.add_argument("--sp1-ranks", type=int, choices=[1, 2], default=2,
                   help="ranks of the sp_size=1 variant: 1 measures what each data-parallel rank does alone, "
                        "where two whole-sample replicas do not fit the machine's memory together")  # fmt: skip
    args = p.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
    if device == "cuda" and torch.cuda.device_count() < 2:
        print("the CUDA variant needs 2 GPUs (one rank each)", file=sys.stderr)
        return 2
    shape = "tiny" if args.tiny else "full"
    sample = {k: v for k, v in (("frames", args.frames), ("side", args.side)) if v is not None}
    rows = [r for sp in (1, 2) for r in measure(sp, shape, device, not args.no_recompute, sample,
                                                world=args.sp1_ranks if sp == 1 else 2)]  # fmt: skip
    r = rows[0]
    print(f"one sample of {r['tokens']} tokens ({r['video_tokens']} video), {shape} model, on {device}: "
          f"sp_size 1 on {args.sp1_ranks} rank(s), sp_size 2 on 2 ranks, recompute {'off' if args.no_recompute else 'on'}")  # fmt: skip
    print(f"{'sp':>3} {'rank':>4} {'loss':>10} {'step s':>8} {'act. peak MiB':>14} {'saved MiB':>10} "
          f"{'vision s':>9} {'vision peak MiB':>16} {'vision saved MiB':>17}")  # fmt: skip
    for r in rows:
        print(f"{r['sp_size']:>3} {r['rank']:>4} {r['loss']:>10.6f} {r['step_time']:>8.2f} "
              f"{r['activation_peak_mib']:>14.1f} {r['saved_mib']:>10.1f} {r['vision_time']:>9.2f} "
              f"{r['vision_peak_mib']:>16.1f} {r['vision_saved_mib']:>17.1f}")  # fmt: skip

    def worst(key, sp):
        return max(r[key] for r in rows if r["sp_size"] == sp)

    one, two = worst("activation_peak_mib", 1), worst("activation_peak_mib", 2)
    s1, s2 = worst("saved_mib", 1), worst("saved_mib", 2)
    v1, v2 = worst("vision_saved_mib", 1), worst("vision_saved_mib", 2)
    losses = {r["sp_size"]: r["loss"] for r in rows if r["rank"] == 0}
    same = abs(losses[1] - losses[2]) <= 1e-4 * max(1.0, abs(losses[1]))

    def ratio(a, b):
        return f"{a / b:.2f}" if b >= 1.0 else "n/a (under 1 MiB)"

    print(
        f"per-rank SP2 / SP1: activation peak {ratio(two, one)} (target <= 0.60), saved for backward "
        f"{ratio(s2, s1)}, vision saved {ratio(v2, v1)}; losses equal: {same} ({losses[1]:.6f} vs {losses[2]:.6f})"
    )
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"device": device, "shape": shape, **r}) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
