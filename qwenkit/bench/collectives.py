"""Counting FSDP2's all-gathers: how often a run gathers its weights (a rollout's, per token or once).

:func:`count_all_gathers` counts the times an FSDP2 unit starts gathering its parameters
(``FSDPParamGroup.unshard`` on a sharded unit with no gather in flight): one per unit per forward
under ``reshard_after_forward``, one per unit for a whole block under
:func:`qwenkit.distributed.unshard.unsharded`. Counting the unit's gathers rather than the process
group's calls gives the same number on one rank (where FSDP2 copies instead of calling the
collective) as on many, so a one-process benchmark reports what a cluster would do.
"""

from __future__ import annotations

import contextlib

from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


@contextlib.contextmanager
def count_all_gathers():
    """Yields a list that holds one entry per unit gather started inside the block: the unit's parameter count."""
    gathers: list[int] = []
    real = FSDPParamGroup.unshard

    def counting(group: FSDPParamGroup, *args, **kwargs):
        if group._all_gather_result is None and not group.is_unsharded:  # the two early returns of unshard
            gathers.append(sum(p._orig_size.numel() for p in group.fsdp_params))
        return real(group, *args, **kwargs)

    FSDPParamGroup.unshard = counting
    try:
        yield gathers
    finally:
        FSDPParamGroup.unshard = real


__all__ = ["count_all_gathers"]
