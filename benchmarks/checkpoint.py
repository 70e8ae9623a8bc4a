"""How long a checkpoint save blocks training: synchronous vs ``checkpoint.async``, state >= 2 GB.

One gloo process, the save qwenkit's trainer does (:func:`qwenkit.engine.checkpoints.dcp.start_save`
and :func:`~qwenkit.engine.checkpoints.dcp.finish`, the same files, manifests and ``COMPLETE.json``)
on a stack of ``Linear(4096, 4096)`` layers with AdamW state (fp32 weights + 2 moments: 3 x 4
bytes per parameter; 11 layers: 2.2 GB). Between saves the benchmark trains real steps
(forward, backward, AdamW) on the same model, so an async save's background write competes with
them, as it would in a run.

- **sync blocked**: the whole ``save`` (DCP write, fsync, CRC-32s, marker, rename);
- **async blocked**: what the trainer waits for, as it waits: ``start_save`` (the state dict
  taken, the copy to CPU memory started in a thread, the rank files), then, in the next step,
  the wait for that copy between backward and the optimizer step (:meth:`Save.wait_staged`:
  the part of the copy the forward and backward did not overlap), and ``finish`` once every
  rank's background write has ended (the marker and rename); the steps' own compute not counted;
- **async write**: how long the copy and the background write took (training went on meanwhile).

    python benchmarks/checkpoint.py [--layers 11] [--repeats 2] [--dir /tmp/qwenkit-ckpt-bench]

Prints a table and, on the last line, a JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.launch import free_port


class _Sampler:  # the data position the trainer saves beside the state (a few integers)
    def state_dict(self):
        return {"epoch": 0, "sample": 0}


def _train_step(model, optimizer, x, pending: ckpt.Save | None = None) -> float:
    """One step; with a save in flight, first waits for its copy before the update, as the trainer
    does. Returns the seconds it waited."""
    model(x).square().mean().backward()
    began = time.perf_counter()
    if pending is not None:
        pending.wait_staged()
    waited = time.perf_counter() - began
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return waited


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=11, help="Linear(4096, 4096) layers: 11 -> 2.2 GB of state")
    p.add_argument("--repeats", type=int, default=2, help="saves of each kind (the median is reported)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(args.layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randn(8, 4096)
    _train_step(model, optimizer, x)  # AdamW state exists
    state_gb = sum(3 * p.numel() * 4 for p in model.parameters()) / 1e9
    where = Path(args.dir or tempfile.mkdtemp(prefix="qwenkit-ckpt-bench-"))
    root, cpu = where / "checkpoints", torch.device("cpu")
    group = ckpt.AsyncSaves(cpu)
    step_s, sync_s, async_blocked, async_write, steps_during = [], [], [], [], []
    for _ in range(3):
        began = time.perf_counter()
        _train_step(model, optimizer, x)
        step_s.append(time.perf_counter() - began)
    step = 0
    for _ in range(args.repeats):
        step += 1
        began = time.perf_counter()
        ckpt.save(root, step, model, optimizer, _Sampler(), cpu, keep_last=1)
        sync_s.append(time.perf_counter() - began)
        step += 1
        began = time.perf_counter()
        pending = ckpt.start_save(root, step, model, optimizer, _Sampler(), cpu, keep_last=1, saves=group)
        blocked = time.perf_counter() - began
        n = 0
        while not ckpt.written_everywhere(pending, cpu):  # training goes on during the copy and the write
            blocked += _train_step(model, optimizer, x, pending)
            n += 1
        async_write.append(time.perf_counter() - began)
        began = time.perf_counter()
        ckpt.finish(pending)
        async_blocked.append(blocked + time.perf_counter() - began)
        steps_during.append(n)
    group.close()
    dist.destroy_process_group()
    if args.dir is None:
        shutil.rmtree(where, ignore_errors=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    result = {
        "state_gb": round(state_gb, 2), "layers": args.layers, "repeats": args.repeats,
        "step_s": round(med(step_s), 3), "sync_blocked_s": round(med(sync_s), 3),
        "async_blocked_s": round(med(async_blocked), 3), "async_write_s": round(med(async_write), 3),
        "steps_during_write": med(steps_during), "ratio": round(med(async_blocked) / med(sync_s), 3),
        "torch": torch.__version__,
    }  # fmt: skip
    print(f"state {result['state_gb']} GB (weights + AdamW), one rank, one training step {result['step_s']} s")
    print("| save | training blocked | background write |")
    print("|---|---|---|")
    print(f"| synchronous | {result['sync_blocked_s']} s | - |")
    print(f"| checkpoint.async | {result['async_blocked_s']} s ({result['ratio']}x) | {result['async_write_s']} s, "
          f"{result['steps_during_write']} steps trained meanwhile |")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
