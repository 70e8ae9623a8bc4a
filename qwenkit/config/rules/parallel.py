"""The rules of ``parallel``."""

from __future__ import annotations

from qwenkit.config.parallel import MAX_RESTARTS
from qwenkit.config.schema import Config, Need


def check(cfg: Config, need: Need) -> None:
    parallel = cfg.parallel
    need(parallel.nproc >= 1, f"parallel.nproc must be >= 1, got {parallel.nproc}")
    need(parallel.hsdp_replicas >= 1, f"parallel.hsdp_replicas must be >= 1, got {parallel.hsdp_replicas}")
    need(parallel.timeout_s >= 1, f"parallel.timeout_s must be >= 1 (seconds), got {parallel.timeout_s}")
    need(0 <= parallel.max_restarts <= MAX_RESTARTS,
         f"parallel.max_restarts must be in [0, {MAX_RESTARTS}], got {parallel.max_restarts}")  # fmt: skip
    need(
        parallel.rendezvous != "static" or parallel.max_restarts == 0,
        f"parallel.max_restarts={parallel.max_restarts} needs parallel.rendezvous=c10d (or auto): "
        "a static rendezvous cannot regroup the nodes after a failure",
    )
    _check_sequence_parallel(cfg, need)
    _check_expert_parallel(cfg, need)


def _check_sequence_parallel(cfg: Config, need: Need) -> None:
    """``parallel.sp_size``; the model's head counts are checked by the launcher (they need its config)."""
    sp = cfg.parallel.sp_size
    need(sp >= 1, f"parallel.sp_size must be >= 1, got {sp}")
    if sp <= 1:
        return
    need(
        cfg.parallel.nproc % sp == 0,
        f"parallel.sp_size={sp} must divide parallel.nproc={cfg.parallel.nproc} (a sequence-parallel group stays on one node)",
    )
    need(cfg.loss.chunk, f"parallel.sp_size={sp} needs loss.chunk=true (each rank computes the chunked loss of its slice)")
    need(
        cfg.loss.loss_type == "token_mean",
        f"parallel.sp_size={sp} supports loss.loss_type=token_mean only, got {cfg.loss.loss_type!r}",
    )
    need(
        cfg.model.attn_implementation in ("sdpa", "eager"),
        f"parallel.sp_size={sp} supports model.attn_implementation sdpa or eager, got {cfg.model.attn_implementation!r}",
    )


# what parallel.ep_size > 1 is not built with yet: (is it on?, the setting named in the refusal)
_EP_NOT_WITH = (
    (lambda c: c.parallel.cpu_offload, "parallel.cpu_offload=true"),
)


def _check_expert_parallel(cfg: Config, need: Need) -> None:
    """``parallel.ep_size``; the family (a MoE?) and its expert count are checked by the launcher
    (:meth:`qwenkit.model.families.entry.Family.problems`: they need the checkpoint's config)."""
    ep = cfg.parallel.ep_size
    need(ep >= 1, f"parallel.ep_size must be >= 1, got {ep}")
    if ep <= 1:
        return
    need(
        cfg.parallel.nproc % ep == 0,
        f"parallel.ep_size={ep} must divide parallel.nproc={cfg.parallel.nproc} (an expert group stays on one node)",
    )
    for on, what in _EP_NOT_WITH:
        need(not on(cfg), f"parallel.ep_size={ep} is not built with {what} yet; use parallel.ep_size=1 for that")
