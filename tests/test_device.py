"""qwenkit.device: what ``auto`` means here, the cores a CPU run may use, memory reads on CPU."""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from qwenkit import device


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_device_count_follows_a_restricted_cpu_set():
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})  # what a taskset or cgroup cpuset does to a job
        assert device.device_count("cpu") == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert device.device_count("cpu") == len(allowed) >= 1
    assert device.device_count("cuda") == torch.cuda.device_count()
    assert device.device_count("npu") == 0 or device.npu_available()


def test_auto_is_cpu_without_accelerators_and_an_explicit_missing_one_is_refused():
    if torch.cuda.is_available() or device.npu_available():
        pytest.skip("an accelerator is visible")
    assert device.resolve_device("auto") == "cpu" and device.resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match=r"^sweep\.device='npu'"):
        device.resolve_device("npu", key="sweep.device")


def test_cpu_peak_memory_restarts_at_the_current_resident_set():
    # 64 MiB on fresh anonymous pages, written, then unmapped: the peak stays above the current resident set
    # (through torch's allocator glibc may reuse free memory still resident from earlier tests in the worker)
    pages = mmap.mmap(-1, 64 * 2**20)
    block = torch.frombuffer(pages, dtype=torch.uint8)
    block.fill_(1)
    del block
    pages.close()
    before = device.memory_bytes("cpu", peak=True)
    device.reset_peak_memory("cpu")
    after = device.memory_bytes("cpu", peak=True)
    assert before - after >= 32 * 2**20  # the 64 MiB were given back by munmap
    assert abs(after - device.memory_bytes("cpu", peak=False)) <= 8 * 2**20
