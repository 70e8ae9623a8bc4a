"""qwenkit.model.losses.registry: the policy losses by name, each entry's surrogate and reduction implemented."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from qwenkit import config as qconfig
from qwenkit.model.losses import policy
from qwenkit.model.losses.registry import POLICY_LOSSES, REDUCTIONS, policy_loss


def test_the_config_allows_exactly_the_registered_losses():
    assert qconfig.GRPO_LOSSES == tuple(POLICY_LOSSES)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_entry_names_a_surrogate_and_a_reduction_that_exist(name):
    entry = POLICY_LOSSES[name]
    module, _, attr = entry.surrogate.partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), entry.surrogate
    assert entry.reduction in REDUCTIONS and entry.peer
    fields = {f.name for f in dataclasses.fields(qconfig.GrpoConfig)}
    assert set(entry.keys) <= fields and {key for key, why in entry.refuses if why} <= fields, entry


def test_a_key_is_read_by_one_loss_alone():
    owned = [k for entry in POLICY_LOSSES.values() for k in entry.keys]
    assert len(owned) == len(set(owned))


def test_every_reduction_is_implemented():
    assert tuple(policy.REDUCE) == REDUCTIONS


def test_an_unknown_loss_is_refused_naming_the_allowed():
    with pytest.raises(ValueError, match=r"grpo.loss_type must be one of .*'dapo'.*got 'nope'"):
        policy_loss("nope")
