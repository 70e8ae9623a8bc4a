"""What the kit changes in vLLM's classes, in the engine's own process, so that vLLM samples from the trainer's model.

The engine runs in the kit's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, :mod:`qwenkit.engine.generation.vllm_engine`),
so a class attribute set here is the one vLLM's model runner calls. Each patch is reversible and observable:
:func:`apply` sets what is not set yet and returns the names it changed (a second call: none), :func:`revert`
puts vLLM's own back; the engine logs what it applied.

- **Qwen2.5-VL's mRoPE positions after a video** (``Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions``).
  A video is one vision span of ``t`` temporal patches whose time positions step by ``tokens_per_second ·
  second_per_grid_ts``. vLLM 0.32 starts the text after any span at the span's largest position + 1, its temporal
  extent included (Qwen's reference and transformers 4.57 do too); transformers 5.19 / 5.24
  (``Qwen2_5_VLModel.get_rope_index``: ``current_pos += max(grid_h, grid_w) // merge``) at the span's start +
  ``max(h, w)``, and the kit trains with transformers' positions. For an image (``t = 1``) the two rules agree.
  :func:`trainer_mrope_positions` is transformers' rule on vLLM's own grid iterator (``iter_mm_grid_thw``: each
  span's offset, merged grid and time step), and its decode offset continues the prompt's last position, as the
  trainer's forward of prompt + completion places the completion (HF's ``generate`` offsets decoding from the
  prompt's largest position instead; the two differ only when a video's temporal extent passes the text after it).
  On the tiny model's video row (fp32) vLLM's greedy log-probs were 2.8e-4 from HF's forward with vLLM's rule (8.5e-4
  on another row), and equal to it with the patch (tests/engine/generation/test_vllm_engine.py).
"""

from __future__ import annotations

import importlib
import logging

import numpy as np
import torch

log = logging.getLogger(__name__)

# the vLLM class attributes the kit replaces: (module, class, attribute) -> the replacement's name here
_ORIGINALS: dict[tuple[str, str, str], object] = {}  # what vLLM had, while patched


def trainer_mrope_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
    """``([3, len(input_tokens)] positions, decode offset)`` of a prompt as transformers 5.x's Qwen2.5-VL
    ``get_rope_index`` places it (module docstring): each text run follows the previous one, each vision span's
    ``[t, h, w]`` grid starts where the text before it ended, and the text after a span starts ``max(h, w)`` on."""
    pieces, start, pos = [], 0, 0  # start: the next token's index; pos: its text position
    for offset, t, h, w, t_factor in self.iter_mm_grid_thw(mm_features):  # h, w merged; t_factor: the time step
        text = offset - start
        pieces.append(np.broadcast_to(np.arange(text), (3, text)) + pos)
        pos += text
        grid = np.indices((t, h, w))  # [3, t, h, w]
        grid[0] = (grid[0] * t_factor).astype(np.int64)
        pieces.append(grid.reshape(3, -1) + pos)
        pos += max(h, w)
        start = offset + t * h * w
    text = len(input_tokens) - start
    pieces.append(np.broadcast_to(np.arange(text), (3, text)) + pos)
    positions = np.concatenate(pieces, axis=1)  # [3, S]
    return torch.from_numpy(positions), int(positions[:, -1].max()) + 1 - len(input_tokens)


def _patches() -> dict[tuple[str, str, str], object]:
    """Every patch: (vLLM module, class, attribute) -> the kit's replacement."""
    return {("vllm.model_executor.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration",
             "get_mrope_input_positions"): trainer_mrope_positions}  # fmt: skip


def _owner(module: str, cls: str):
    return getattr(importlib.import_module(module), cls)


def apply() -> list[str]:
    """Set every patch not set yet; returns the ``Class.attribute`` names set now (none on a second call)."""
    done = []
    for (module, cls, attr), new in _patches().items():
        try:
            owner = _owner(module, cls)
        except (ImportError, AttributeError):  # a vLLM without the model (a stand-in, another build): nothing to patch
            continue
        if owner.__dict__.get(attr) is new:
            continue
        _ORIGINALS[(module, cls, attr)] = owner.__dict__[attr]
        setattr(owner, attr, new)
        done.append(f"{cls}.{attr}")
    if done:
        log.info("vLLM patched for the trainer's positions: %s", ", ".join(done))
    return done


def revert() -> list[str]:
    """vLLM's own attributes back (tests); returns the names restored."""
    done = []
    for (module, cls, attr), old in list(_ORIGINALS.items()):
        setattr(_owner(module, cls), attr, old)
        del _ORIGINALS[(module, cls, attr)]
        done.append(f"{cls}.{attr}")
    return done


__all__ = ["apply", "revert", "trainer_mrope_positions"]
