"""A sharded model's weights whole for a while: every FSDP2 unit gathered once, kept until the block ends
(a GRPO rollout generates token by token inside it with no collective per token;
:mod:`qwenkit.engine.rollouts.hf`)."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.fsdp import FSDPModule


@contextlib.contextmanager
def unsharded(model: nn.Module):
    """Every FSDP2 unit of ``model`` all-gathered once and kept whole until the block ends.

    Collective: every rank enters (the units are gathered in module order) and leaves together.
    Inside, a forward all-gathers nothing (each unit's pre-forward finds its parameters whole,
    and its post-forward keeps them: ``reshard_after_forward`` is off for the block), so a rank
    may run as many forwards as it likes on its own, e.g. token-by-token generation: one
    all-gather per unit, whatever the number of tokens. The parameters are FSDP's own unsharded
    ones (in ``MixedPrecisionPolicy.param_dtype``), the weights the training forward computes
    with; the memory is that of a full copy. On leaving, every unit is resharded and gets its
    own ``reshard_after_forward`` back. A model without FSDP units is used as it is.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    # the setting each unit had (read from FSDP2's state: no public getter), put back on leaving
    before = [any(g._reshard_after_forward for g in m._get_fsdp_state()._fsdp_param_groups) for m in units]
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        yield model
    finally:
        for unit, setting in zip(units, before):
            unit.reshard()
            unit.set_reshard_after_forward(setting, recurse=False)

