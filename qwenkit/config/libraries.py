"""Which library an option needs, and whether it is installed (without importing it)."""

from __future__ import annotations

import importlib.util
import sys

FUSED_LIBRARIES = {"npu": "torch_npu", "cuda": "liger_kernel"}  # backend -> the library its kernels import
PIP_NAMES = {"torch_npu": "torch_npu", "liger_kernel": "liger-kernel"}  # import name -> what to install


def installed(library: str) -> bool:
    """Whether ``library`` can be imported, without importing it."""
    if sys.modules.get(library) is not None:
        return True
    try:
        return importlib.util.find_spec(library) is not None
    except ValueError:  # in sys.modules with no spec
        return False
