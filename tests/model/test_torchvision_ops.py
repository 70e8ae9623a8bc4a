"""qwenkit.model.torchvision_ops: torchvision's two operators declared only where a CUDA torchvision sits beside a CPU torch."""

import subprocess
import sys
from importlib import metadata

import pytest

from qwenkit.model import torchvision_ops


@pytest.mark.parametrize(
    "torch_version, vision_version, want",
    [("2.13.0+cpu", "0.28.0", True), ("2.13.0+cpu", "0.28.0+cpu", False), ("2.13.0", "0.28.0", False),
     ("2.13.0+cpu", None, False)],
)  # fmt: skip
def test_mismatched_is_a_cuda_torchvision_beside_a_cpu_torch(monkeypatch, torch_version, vision_version, want):
    def version(name):
        found = {"torch": torch_version, "torchvision": vision_version}[name]
        if found is None:
            raise metadata.PackageNotFoundError(name)
        return found

    monkeypatch.setattr(torchvision_ops.metadata, "version", version)
    assert torchvision_ops.mismatched() is want


def test_the_declared_operators_have_torchvisions_schemas_and_no_kernel():
    """In a fresh interpreter (the declaration is process-wide): what torchvision's fake registrations need."""
    code = (
        "import torch; from qwenkit.model import torchvision_ops as t\n"
        "t.mismatched = lambda: True\n"
        "assert t.declare_missing_ops() == ['nms', 'qnms'] and t.declare_missing_ops() == ['nms', 'qnms']\n"
        "print(torch.ops.torchvision.nms.default._schema)\n"
        "torch.library.register_fake('torchvision::nms')(lambda dets, scores, iou_threshold: dets.new_empty(0))\n"
        "try:\n    torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)\nexcept NotImplementedError:\n    print('no kernel')\n"
    )  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torchvision::nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor" in out.stdout
    assert "no kernel" in out.stdout


def test_nothing_is_declared_here_unless_mismatched():
    assert torchvision_ops.declare_missing_ops() == ([] if not torchvision_ops.mismatched() else ["nms", "qnms"])
