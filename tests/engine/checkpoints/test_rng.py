"""The random state a checkpoint carries (qwenkit.engine.checkpoints.rng): saved and read back with
``torch.load(weights_only=True)``, it replays python's, numpy's and torch's draws."""

from __future__ import annotations

import random

import numpy as np
import torch

from qwenkit.engine.checkpoints.rng import rng_state, set_rng_state


def test_rng_state_round_trip(tmp_path):
    device = torch.device("cpu")
    state = rng_state(device)
    torch.save(state, tmp_path / "rng.pt")
    first = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), device)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == again[:2]
    assert torch.equal(first[2], again[2])
