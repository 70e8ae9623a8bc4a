"""Which device a process runs on: the one rule for ``auto`` that trainer, launcher and notebooks share.

``auto`` picks CUDA, then an Ascend NPU (when ``torch_npu`` is installed and sees one), then CPU.
An explicit ``cuda`` or ``npu`` that is not there fails here, naming the setting, rather than at
the first tensor moved.
"""

from __future__ import annotations

import os

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
