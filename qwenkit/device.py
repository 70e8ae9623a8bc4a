"""Which device a process runs on, and how much memory it holds there.

``auto`` picks CUDA, then an Ascend NPU (when ``torch_npu`` is installed and sees one), then CPU:
the one rule trainer, launcher and notebooks share. An explicit ``cuda`` or ``npu`` that is not
there fails here, naming the setting, rather than at the first tensor moved.

:func:`memory_bytes` is the one way memory is read (training metrics, the profiler's CPU
snapshot, the measuring harness, the benchmarks): the allocator's bytes on an accelerator, the
process's resident set on the CPU; :func:`free_memory_bytes` what is left to take.
"""

from __future__ import annotations

import os
import resource

import torch

DEVICES = ("auto", "cpu", "cuda", "npu")

# glibc raises its mmap threshold to the largest block freed (up to 32 MiB), after which
# activation-sized tensors come from the heap and fragment it: peak RSS then grew ~1 GiB above
# the live tensors on the Qwen2.5-VL step benchmark, and steps ran slower. Pinning it keeps big
# tensors mmapped, returned to the OS when freed. CPU ranks only; a value the user set wins.
CPU_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


def resolve_device(name: str, key: str = "parallel.device") -> str:
    """``auto`` picks cuda, then npu (torch_npu), then cpu; ``key`` names the setting in errors."""
    if name not in DEVICES:
        raise ValueError(f"{key}={name!r}: expected one of {', '.join(DEVICES)}")
    if name != "auto":
        if name == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"{key}='cuda' but no CUDA device is visible")
        if name == "npu" and not npu_available():
            raise ValueError(f"{key}='npu' but torch_npu is not installed or no NPU is visible")
        return name
    if torch.cuda.is_available():
        return "cuda"
    if npu_available():
        return "npu"
    return "cpu"


def memory_bytes(device: torch.device | str, peak: bool = True) -> int:
    """Memory this process holds on ``device``; ``peak``: the most since :func:`reset_peak_memory`.

    Accelerator: the caching allocator's allocated bytes (``max_memory_allocated`` /
    ``memory_allocated``). CPU: the resident set from ``/proc/self/status`` (``VmHWM`` /
    ``VmRSS``), the process's peak since it started unless reset; ``getrusage``'s ``ru_maxrss``
    where there is no ``/proc`` (peak only).
    """
    device = torch.device(device)
    if device.type != "cpu":
        memory = torch.get_device_module(device.type)  # torch.accelerator's memory calls need torch 2.8+
        return memory.max_memory_allocated(device) if peak else memory.memory_allocated(device)
    field = "VmHWM:" if peak else "VmRSS:"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    if peak:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    raise RuntimeError(f"{field[:-1]} not in /proc/self/status: the current resident set is unknown here")


def free_memory_bytes(device: torch.device | str) -> int:
    """Memory a new tensor on ``device`` could still take: on an accelerator the device's free
    bytes (``mem_get_info``) plus what the caching allocator holds unused; on the CPU the host's
    ``MemAvailable`` (``/proc/meminfo``), shared by every process on it."""
    device = torch.device(device)
    if device.type != "cpu":
        memory = torch.get_device_module(device.type)
        free, _ = memory.mem_get_info(device)
        return free + memory.memory_reserved(device) - memory.memory_allocated(device)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("MemAvailable not in /proc/meminfo: the host's free memory is unknown here")


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak for :func:`memory_bytes`: the allocator's statistics, or on CPU ``VmHWM := VmRSS``."""
    device = torch.device(device)
    if device.type != "cpu":
        torch.get_device_module(device.type).reset_peak_memory_stats(device)
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def device_count(device: str) -> int:
    """Devices of type ``device`` this process sees: accelerators, or for ``cpu`` the cores it may run on."""
    if device == "cuda":
        return torch.cuda.device_count()
    if device == "npu":
        return torch.npu.device_count() if npu_available() else 0
    if hasattr(os, "sched_getaffinity"):  # a taskset / cgroup cpuset limits this below os.cpu_count()
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def npu_available() -> bool:
    """Whether an Ascend NPU is usable; importing ``torch_npu`` also registers the ``npu`` device type."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()
