"""qwenkit.engine.run.profiling: the profiler window records exactly its ``active`` steps (torch.profiler's
own trace is the reference) and, on CPU, the memory file at the window's end; disabled, it writes nothing."""

from __future__ import annotations

import json

import torch

from qwenkit import config as qconfig
from qwenkit.engine.run.profiling import ProfileWindow


def _steps(window: ProfileWindow, n: int) -> None:
    a = torch.randn(32, 32)
    for _ in range(n):
        with torch.no_grad():
            a = torch.tanh(a @ a)
        window.step()
    window.close()


def test_the_window_traces_its_active_steps_and_writes_the_memory_file(tmp_path):
    cfg = qconfig.load(overrides=["profile.enabled=true", "profile.wait=1", "profile.warmup=1", "profile.active=2",
                                  "profile.memory_snapshot=true"]).profile  # fmt: skip
    _steps(ProfileWindow(cfg, torch.device("cpu"), tmp_path, rank=1), 6)
    trace = json.loads((tmp_path / "profile" / "rank-00001.json").read_text())
    steps = sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]  # after 1 idle and 1 warmup step
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    memory = json.loads((tmp_path / "memory" / "rank-00001.json").read_text())
    assert memory["step"] == 4 and memory["peak_rss_mib"] >= memory["rss_mib"] > 0  # dumped when the window closed


def test_disabled_it_writes_nothing(tmp_path):
    _steps(ProfileWindow(qconfig.load().profile, torch.device("cpu"), tmp_path, rank=0), 3)
    assert list(tmp_path.iterdir()) == []
