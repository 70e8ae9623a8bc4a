"""A profiling window over training steps: torch.profiler traces and memory snapshots.

``profile.enabled`` runs ``torch.profiler`` for ``wait`` steps idle, ``warmup`` steps traced but
discarded, then ``active`` steps recorded, and writes one Chrome/Perfetto trace per rank:
``<output_dir>/profile/rank-00000.json`` (open in https://ui.perfetto.dev or chrome://tracing).
On NPU, torch_npu's profiler (same schedule) writes its own trace folder there.

``profile.memory_snapshot`` records allocator history over the same window (from the first
warmup step to the last active one) and writes ``<output_dir>/memory/rank-00000.pickle`` on
CUDA (drag into https://pytorch.org/memory_viz) and NPU; on CPU, where there is no caching
allocator, it writes the process's peak and current RSS to ``rank-00000.json`` at the window's end.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from qwenkit.device import memory_bytes

log = logging.getLogger(__name__)


class ProfileWindow:
    """Call :meth:`step` once after every training step; :meth:`close` at the end."""

    def __init__(self, profile_cfg, device: torch.device, output_dir: str | Path, rank: int):
        self.cfg, self.device, self.rank = profile_cfg, device, rank
        self.out = Path(output_dir)
        self.steps_done = 0
        self.start = profile_cfg.wait  # steps before the window opens
        self.end = profile_cfg.wait + profile_cfg.warmup + profile_cfg.active  # steps when it closes
        self.prof = self._profiler() if profile_cfg.enabled else None
        if self.prof is not None:
            self.prof.start()
        self.recording = False
        self._maybe_toggle_memory()

    def _profiler(self):
        if self.device.type == "npu":
            import torch_npu

            npu_prof = torch_npu.profiler
            return npu_prof.profile(
                activities=[npu_prof.ProfilerActivity.CPU, npu_prof.ProfilerActivity.NPU],
                schedule=npu_prof.schedule(wait=self.cfg.wait, warmup=self.cfg.warmup, active=self.cfg.active, repeat=1),
                on_trace_ready=npu_prof.tensorboard_trace_handler(str(self.out / "profile")),
                profile_memory=True,
            )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=self.cfg.wait, warmup=self.cfg.warmup, active=self.cfg.active, repeat=1),
            on_trace_ready=self._write_trace,
            profile_memory=True,
            record_shapes=True,
        )

    def _write_trace(self, prof) -> None:
        path = self.out / "profile" / f"rank-{self.rank:05d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        log.info("profiler trace written to %s", path)

    def step(self) -> None:
        self.steps_done += 1
        if self.prof is not None:
            self.prof.step()
        self._maybe_toggle_memory()

    def _maybe_toggle_memory(self) -> None:
        if not self.cfg.memory_snapshot:
            return
        if not self.recording and self.start <= self.steps_done < self.end:
            self._record(True)
        elif self.recording and self.steps_done >= self.end:
            self._dump()
            self._record(False)

    def _record(self, on: bool) -> None:
        self.recording = on
        if self.device.type == "cuda":
            memory = torch.cuda.memory
        elif self.device.type == "npu":
            import torch_npu

            memory = torch_npu.npu.memory
        else:
            return
        if on:
            memory._record_memory_history(max_entries=100_000)
        else:
            memory._record_memory_history(enabled=None)

    def _dump(self) -> None:
        folder = self.out / "memory"
        folder.mkdir(parents=True, exist_ok=True)
        if self.device.type == "cuda":
            path = folder / f"rank-{self.rank:05d}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
        elif self.device.type == "npu":
            import torch_npu

            path = folder / f"rank-{self.rank:05d}.pickle"
            torch_npu.npu.memory._dump_snapshot(str(path))
        else:
            path = folder / f"rank-{self.rank:05d}.json"
            rss = {"peak_rss_mib": memory_bytes("cpu") / 2**20, "rss_mib": memory_bytes("cpu", peak=False) / 2**20}
            path.write_text(json.dumps({"step": self.steps_done, **rss}))
        log.info("memory snapshot written to %s", path)

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
        if self.recording:
            self._dump()
            self._record(False)

