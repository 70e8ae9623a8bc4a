"""Per-call routing: the device of the input tensor picks torch_npu, Liger, or the original op.

A patched module's forward asks its :class:`Router` at every call. The answer depends on the
tensor in hand, not on where the model was when it was patched, so a model moved between
devices stays correct, and a CPU tensor always runs HF's own code (bit-identical).

    tensor device   backend "auto"              backend "npu"    backend "cuda"
    npu             torch_npu  (npu.py)         torch_npu        original
    cuda            Liger if installed (cuda.py) original         Liger
    anything else   original                    original         original

The kernel libraries are imported on the first call that needs them, never before; a
library that fails to import is remembered (and logged once), and that route then runs the
original op.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import types
from collections.abc import Callable

import torch

from qwenkit.config import PIP_NAMES, installed
from qwenkit.patches import cuda, npu, targets
from qwenkit.patches.report import PatchError

log = logging.getLogger(__name__)

DeviceOf = Callable[[torch.Tensor], str]
ROUTES: dict[str, types.ModuleType] = {"npu": npu, "cuda": cuda}  # tensor device type -> kernels
VISION_ROPE_FN = "apply_rotary_pos_emb_vision"  # the module-level function HF's vision attention calls

_missing: set[str] = set()  # libraries whose import failed in this process
_announced: set[tuple[str, str, str]] = set()  # (op, device, implementation) already logged


def tensor_device(t: torch.Tensor) -> str:
    """The default device predicate: ``"npu"``, ``"cuda"``, ``"cpu"``, ``"meta"``, ..."""
    return t.device.type


def _importable(library: str) -> bool:
    if sys.modules.get(library) is not None:
        return True
    if library in _missing:
        return False
    try:
        importlib.import_module(library)
    except ImportError as e:
        _missing.add(library)
        log.warning("%s is not importable (%s): fused ops on its device run the original ops", library, e)
        return False
    return True


class Router:
    """Answers, for one call, which kernels module runs an op (``None``: the original op)."""

    def __init__(self, backend: str, device_of: DeviceOf | None = None):
        self.backend = backend  # "auto", "npu" or "cuda"
        self.device_of = device_of or tensor_device

    def kernels(self, op: str, tensor: torch.Tensor) -> types.ModuleType | None:
        device = self.device_of(tensor)
        kernels = ROUTES.get(device)
        if kernels is not None and (self.backend not in ("auto", device) or not _importable(kernels.LIBRARY)):
            kernels = None
        key = (op, device, kernels.KERNELS[op] if kernels is not None else "original")
        if key not in _announced:
            _announced.add(key)
            log.info("fused op %s on %s tensors runs %s", *key)
        return kernels


def routes(backend: str) -> dict[str, str]:
    """What each tensor device will run under ``backend`` (for the patch report)."""
    out = {}
    for device, kernels in ROUTES.items():
        pip_name = PIP_NAMES[kernels.LIBRARY]
        if backend not in ("auto", device):
            out[device] = f"original (backend={backend})"
        elif installed(kernels.LIBRARY):
            out[device] = pip_name
        else:
            out[device] = f"original ({pip_name} not installed)"
    out["other devices"] = "original"
    return out


# ---------------------------------------------------------------------------------------------
# Forwards installed on module instances (bound with types.MethodType, so deepcopy rebinds them)


def rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """RMSNorm (text and vision), HF's ``weight * norm(x)`` or the zero-centred ``(1 + weight) * norm(x)``. Input and weight of different dtypes (fp32 weight on a bf16
    input) keep HF's path: HF returns the promoted dtype there, the kernels the input's."""
    kernels = None
    if hidden_states.dtype == self.weight.dtype:
        kernels = self._qwenkit_patch.router.kernels("rms_norm", hidden_states)
    if kernels is None:
        return self._qwenkit_original_forward(hidden_states)
    if targets.zero_centred(type(self)):  # (1 + weight), in fp32 (targets._is_rms_norm)
        return kernels.zero_centred_rms_norm(hidden_states, self.weight, self.eps)
    return kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def swiglu_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Text MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the gated product fused."""
    kernels = self._qwenkit_patch.router.kernels("swiglu", x)
    if kernels is None:
        return self._qwenkit_original_forward(x)
    return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


def with_vision_rope(forward: Callable, router: Router) -> types.FunctionType:
    """HF's vision-attention forward, calling a routed ``apply_rotary_pos_emb_vision``.

    The rotary function is a module-level global that the forward looks up at call time, so no
    instance attribute can reach it. Instead of copying the forward (it differs between
    transformers 4.57 and 5.x), this returns a function with HF's own code object and a copy
    of its module globals in which that one name is routed; everything else the forward uses
    resolves to the same objects. Zero copied lines; if HF stops calling the function by this
    name, the patch fails loudly here instead of silently doing nothing.
    """
    fn = getattr(forward, "__func__", forward)
    if not isinstance(fn, types.FunctionType) or VISION_ROPE_FN not in fn.__code__.co_names:
        raise PatchError(
            f"vision_rope: {getattr(fn, '__qualname__', fn)!r} does not call {VISION_ROPE_FN}; this "
            "transformers version is not supported by the patch (leave 'vision_rope' out of model.fused_ops)"
        )
    original_rope = fn.__globals__[VISION_ROPE_FN]

    def routed_rope(q, k, cos, sin):
        kernels = router.kernels("vision_rope", q)
        if kernels is None:
            return original_rope(q, k, cos, sin)
        return kernels.vision_rope(q, k, cos, sin)

    namespace = dict(fn.__globals__)
    namespace[VISION_ROPE_FN] = routed_rope
    routed = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    routed.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(routed, fn)
