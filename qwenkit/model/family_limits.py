"""What a family entry checks its config against: its layer kinds (:data:`MIXERS`), the features
it has not made exact (:data:`NOT_EXACT`), a router's aux loss under sequence parallelism and
expert parallelism against the checkpoint. :meth:`qwenkit.model.family_entry.Family.problems` asks them.

Light on purpose, as :mod:`qwenkit.model.family` and :mod:`qwenkit.model.family_entry`: the standard library only.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotation only: family_entry imports this module
    from qwenkit.model.family_entry import Family


@dataclass(frozen=True)
class Mixer:
    """What one kind of sequence-mixing layer supports; a family lists its kinds in ``Family.mixers`` (:mod:`qwenkit.model.family_entry`).

    A setting that would run a layer kind wrongly without a word is refused for every family that
    has such a layer, until it is exact (docs/ARCHITECTURE.md, "A new model family").
    """

    # Ulysses (parallel.sp_size > 1) reroutes the attention functions only (qwenkit.distributed.sequence):
    # any other layer would run on one rank's slice of the sequence
    sequence_parallel: bool
    # data.packing: samples of a row kept apart by per-sample positions and the attention mask
    packing: bool
    attn_implementations: tuple[str, ...]  # model.attn_implementation values the layer runs with


_ATTN = ("sdpa", "eager", "flash_attention_2")
# every layer kind a family may list; a new kind says here what it can do
MIXERS: dict[str, Mixer] = {
    "attention": Mixer(sequence_parallel=True, packing=True, attn_implementations=_ATTN),
    # Gated DeltaNet (Qwen3.5): a causal conv1d and a recurrent state along the sequence. Packed rows
    # restart both at every sample, and under Ulysses each rank runs them on whole sequences for its
    # heads (qwenkit.model.linear_attention); the attention implementation is its full-attention layers'
    "linear_attention": Mixer(sequence_parallel=True, packing=True, attn_implementations=_ATTN),
}


# features a family's entry may list in ``not_exact``: (the setting as a person writes it, whether cfg turns it on)
NOT_EXACT = {
    "packing": (lambda cfg: "data.packing=true", lambda cfg: bool(cfg.data.packing)),
    "sequence parallelism": (lambda cfg: f"parallel.sp_size={cfg.parallel.sp_size}", lambda cfg: cfg.parallel.sp_size > 1),
    "LoRA": (lambda cfg: f"lora.r={cfg.lora.r}", lambda cfg: cfg.lora.r > 0),
    "DPO": (lambda cfg: "train.objective=dpo", lambda cfg: cfg.train.objective == "dpo"),
    "GRPO": (lambda cfg: "train.objective=grpo", lambda cfg: cfg.train.objective == "grpo"),
    "expert parallelism": (lambda cfg: f"parallel.ep_size={cfg.parallel.ep_size}", lambda cfg: cfg.parallel.ep_size > 1),
}


def text_config(family: Family, path: str | Path) -> dict:
    """The text decoder's section of the checkpoint's ``config.json``: ``text_config`` (or the file itself),
    inside the part's section of a checkpoint of ``family``'s whole model (a full Omni one: ``thinker_config``)."""
    config = json.loads((Path(path) / "config.json").read_text())
    whole = family.whole
    if whole is not None and config.get("model_type") == whole.model_type:
        config = config[f"{whole.part}_config"]
    return config.get("text_config", config)


def aux_loss_sp_problem(family: Family, path: str | Path, sp_size: int) -> str | None:
    """Why ``parallel.sp_size`` > 1 cannot train the checkpoint at ``path`` (of ``family``, one with ``aux_loss``) exactly.

    A router's load-balancing loss is a product of two means over the tokens of the forward
    (the fraction routed to each expert times its mean probability): under Ulysses each rank
    routes only its slice of the sequence, and no sum or mean of the slices' losses is the loss of
    the whole sequence. So it is refused with SP while the checkpoint's config turns the loss on
    (``text_config.output_router_logits``, ``router_aux_loss_coef`` > 0).
    """
    text = text_config(family, path)
    coef = text.get("router_aux_loss_coef", 0)
    if not (text.get("output_router_logits") and coef):
        return None
    return (
        f"parallel.sp_size={sp_size} with the router's auxiliary loss on ({path}/config.json: text_config."
        f"output_router_logits=true, router_aux_loss_coef={coef}): each rank would balance the experts over its "
        "slice of the sequence only, which is not the loss of the whole sequence; use parallel.sp_size=1, or set "
        "output_router_logits=false there"
    )


def expert_parallel_problem(family: Family, path: str | Path | None, ep_size: int) -> str | None:
    """Why ``parallel.ep_size`` cannot split ``family``'s experts, or None: a family without routed
    experts (its entry's ``experts``); transformers 4.x, whose experts take the router's dense weights
    (``forward(hidden, routing_weights, router_indices)``), not the top-k ones; an expert count of the
    checkpoint at ``path`` that ``ep_size`` does not divide (each rank holds whole experts)."""
    if not family.experts:
        return f"parallel.ep_size={ep_size}: {family.name} has no routed experts to split (a dense family); use parallel.ep_size=1"
    version = importlib.metadata.version("transformers")
    if int(version.split(".")[0]) < 5:
        return f"parallel.ep_size={ep_size} needs transformers >= 5 (installed: {version}); use parallel.ep_size=1"
    if path is None:
        return None
    text = text_config(family, path)
    experts = text.get("num_experts", text.get("num_local_experts"))  # the hub's name; what transformers 5 writes
    if not experts or experts % ep_size:
        return (
            f"parallel.ep_size={ep_size} must divide the expert count ({path}/config.json: text_config."
            f"num_experts={experts}): each rank holds whole experts"
        )
    return None
