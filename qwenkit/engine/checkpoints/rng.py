"""The random state a checkpoint carries per rank: python's, numpy's, torch's CPU and the accelerator's
generators, in types ``torch.load(weights_only=True)`` reads (:mod:`qwenkit.engine.checkpoints.dcp`)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(device: torch.device) -> dict:
    """python, numpy, torch CPU and accelerator generator states, in types torch.load(weights_only) reads."""
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {**np_state, "state": {"key": np_state["state"]["key"].tolist(), "pos": np_state["state"]["pos"]}},
        "torch": torch.get_rng_state(),
    }
    if device.type != "cpu":
        state["accelerator"] = torch.get_device_module(device.type).get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    key = np.asarray(np_state["state"]["key"], dtype=np.uint32)
    np.random.set_state({**np_state, "state": {"key": key, "pos": np_state["state"]["pos"]}})
    torch.set_rng_state(state["torch"])
    if device.type != "cpu" and "accelerator" in state:
        torch.get_device_module(device.type).set_rng_state(state["accelerator"], device)
