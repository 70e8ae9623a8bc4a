"""One family's entry: the :class:`Family` dataclass, what it holds and what it answers.

The entries themselves, one per family, and the lookups by name or checkpoint are in
:mod:`qwenkit.model.families.registry` (:data:`qwenkit.model.families.registry.FAMILIES`). An entry answers for its
family: its classes by import path (:meth:`Family.load`), whether this transformers has it
(:meth:`Family.unavailable`), which part a module path belongs to (:meth:`Family.part_of`), what LoRA
adapts, and what of a config the family cannot run (:meth:`Family.problems`), against the limits that
sit here beside it: the layer kinds (:data:`MIXERS`), the features not yet exact (:data:`NOT_EXACT`), a
router's aux loss under sequence parallelism and expert parallelism against the checkpoint.

Light on purpose, as :mod:`qwenkit.model.families.registry`: the standard library and :mod:`qwenkit.model.modules` only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from qwenkit.model.modules import prefix_match

__all__ = ["MIXERS", "NOT_EXACT", "Family", "Mixer", "Whole", "aux_loss_sp_problem", "expert_parallel_problem",
           "routing_replay_problem", "text_config"]


# What an entry checks a config against (Family.problems): its layer kinds, the features it has not made
# exact, a router's aux loss under sequence parallelism, expert parallelism against the checkpoint

@dataclass(frozen=True)
class Mixer:
    """What one kind of sequence-mixing layer supports; a family lists its kinds in ``Family.mixers`` (:mod:`qwenkit.model.families.entry`).

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
    # heads (qwenkit.model.families.linear_attention); the attention implementation is its full-attention layers'
    "linear_attention": Mixer(sequence_parallel=True, packing=True, attn_implementations=_ATTN),
    # full attention behind the QSA token indexer (Qwen4-Exp): the indexer pools each query's visible keys into
    # blocks from the first one and picks blocks by score over all of them, which a rank holding a slice of the
    # sequence cannot do; a packed row's block-causal mask starts its blocks at each sample. HF gives it no flash path
    "indexed_attention": Mixer(sequence_parallel=False, packing=True, attn_implementations=("sdpa", "eager")),
}


# features a family's entry may list in ``not_exact``: (the setting as a person writes it, whether cfg turns it on)
NOT_EXACT = {
    "packing": (lambda cfg: "data.packing=true", lambda cfg: bool(cfg.data.packing)),
    "sequence parallelism": (lambda cfg: f"parallel.sp_size={cfg.parallel.sp_size}", lambda cfg: cfg.parallel.sp_size > 1),
    "LoRA": (lambda cfg: f"lora.r={cfg.lora.r}", lambda cfg: cfg.lora.r > 0),
    "DPO": (lambda cfg: "train.objective=dpo", lambda cfg: cfg.train.objective == "dpo"),
    # on-policy distillation rolls out and scores its tokens as GRPO does (qwenkit.engine.objectives.distill)
    "GRPO": (lambda cfg: f"train.objective={cfg.train.objective}", lambda cfg: cfg.train.objective in ("grpo", "distill")),
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


def routing_replay_problem(family: Family) -> str | None:
    """Why ``grpo.routing_replay`` cannot replay ``family``'s routing, or None: a dense family (no ``routers``), or
    transformers 4.x, whose MoE blocks route inline (the router a linear, no top-k to force)."""
    if not family.routers:
        return f"grpo.routing_replay=true: {family.name} routes no experts (a dense family); unset it"
    version = importlib.metadata.version("transformers")
    if int(version.split(".")[0]) < 5:
        return (f"grpo.routing_replay=true needs transformers 5.x, whose routers return their top-k experts; "
                f"{version}'s {family.name} routes inside its MoE block")  # fmt: skip
    return None


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


@dataclass(frozen=True)
class Whole:
    """The whole model a family's model is one part of, as its checkpoints ship it: Qwen-Omni's thinker
    beside the talker and the vocoder (token2wav, code2wav). qwenkit trains the part; a checkpoint of the
    whole is read for the part's weights and config, and the export writes the whole back
    (:func:`qwenkit.engine.checkpoints.export.keep_whole`)."""

    model_type: str  # the whole checkpoint's config.json model_type
    hf_class: str  # transformers' class of the whole, "module:attr": what an export of it loads in
    tiny_config: str  # the tiny whole's config builder around the family's tiny config, "module:attr"
    part: str = "thinker"  # the part's attribute in the whole: its key prefix and its "<part>_config"
    # files beside the weights that HF's class of the whole reads (Qwen2.5-Omni's speakers: from_pretrained
    # refuses a directory without them); the tiny whole writes them, the export carries them
    files: tuple[str, ...] = ()

    @property
    def prefix(self) -> str:
        return f"{self.part}."

    def load(self, what: str):
        """The class (or function) an import path of the whole names (``hf_class``, ``tiny_config``)."""
        return _imported(getattr(self, what))


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: ``"5.23.0.dev0"`` -> ``(5, 23)``, ``"5"`` -> ``(5, 0)``."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    return (parts + [0])[0], (parts + [0, 0])[1]


def _imported(path: str):
    """What an import path ``module:attr`` names."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Family:
    name: str  # model.name
    model_type: str  # config.json's model_type
    hf_class: str  # transformers' class, "module:attr"
    subclass: str  # qwenkit's chunk-loss subclass, "module:attr"
    tiny_config: str  # the tiny default's config builder, "module:attr"
    # (parameter-count part, module-path prefixes), first match wins; model.freeze names these paths too
    parts: tuple[tuple[str, tuple[str, ...]], ...]
    # "text" / "vision" / "mtp" (the MTP layer model.mtp.train attaches): module-path prefixes LoRA adapts
    lora_towers: dict[str, tuple[str, ...]]
    shard_units: tuple[str, ...]  # parallel.shard_patterns for this family's module tree
    recompute_units: tuple[str, ...]  # parallel.recompute: the decoder layers
    fused_ops: tuple[str, ...]  # model.fused_ops that match this family's modules
    patch_size: int  # vision patch side in pixels (a merged token covers patch_size * merge)
    merge_size: int = 2
    # videos: one span per temporal patch, each after a "<t seconds>" timestamp (Qwen3-VL), or one span
    video_timestamps: bool = False
    # the chat template the family's checkpoints ship ("module:attr"; the tiny checkpoint writes it) and
    # the system text it writes when a conversation has none (data.system_prompt unset); qwenkit.data.template
    chat_template: str = "qwenkit.model.processor:CHAT_TEMPLATE"
    default_system: str | None = "You are a helpful assistant."
    # frame sampling and resizing of videos: the name of transformers' video processor class that
    # qwenkit.data.video.RULES follows
    video_rule: str = "Qwen2VLVideoProcessor"
    # the replies after the last user turn open with a thinking block (Qwen3.5: "<think>\n\n</think>\n\n" when empty)
    think_tags: bool = False
    # how the family's template writes a tool call: hermes (Qwen2.5/Qwen3-VL: <tool_call>{"name", "arguments"}</tool_call>)
    # or xml (Qwen3.5: <tool_call><function=name><parameter=p>value</parameter></function></tool_call>);
    # qwenkit.data.tool_calls renders and parses both
    tool_calls: str = "hermes"
    aux_loss: bool = False  # the router's load-balancing loss joins the training loss (MoE)
    mixers: tuple[str, ...] = ("attention",)  # the text decoder's sequence-mixing layer kinds (MIXERS)
    # the boxes the family writes (grounding): pixels of the resized image (Qwen2.5-VL) or per_mille,
    # 0-1000 of the width and height (Qwen3-VL); the iou reward (qwenkit.engine.objectives.rewards) reads it
    box_units: str = "pixels"
    # the routed-experts modules (fused 3-D gate_up_proj / down_proj, HF's forward(hidden, top_k_index,
    # top_k_weights)) that parallel.ep_size splits across ranks (qwenkit.distributed.expert); () = a dense family
    experts: tuple[str, ...] = ()
    # the routers beside them (transformers 5.x: forward(hidden) -> (logits, top_k_weights, top_k_index)), whose
    # choices grpo.routing_replay records in the rollout and forces in the training forward
    # (qwenkit.model.routing_replay); () = nothing to replay
    routers: tuple[str, ...] = ()
    # linears of the towers LoRA never adapts, not even with all-linear: a MoE's router (a linear in
    # transformers 4.57, a parameter in 5.x: adapted in one and not the other, routing would differ by version)
    lora_exclude: tuple[str, ...] = ()
    # multi-token-prediction layers the family's checkpoints ship as mtp.* (Qwen3.5): HF's class does not
    # load them, export keeps them (qwenkit.engine.checkpoints.export.keep_mtp), the tiny checkpoint writes them
    mtp_layers: int = 0
    # the audio placeholder tokens (start, pad, end) of a family that hears (Omni); () = no audio tower
    audio_tokens: tuple[str, ...] = ()
    # the transformers submodule that holds the family (default: model_type) and the oldest release, "major.minor",
    # that has it with the module tree the subclass fits (4.57's Omni thinker has no multimodal backbone under
    # ``model``; qwen4_exp came in 5.23); "": any release that has the submodule
    hf_module: str = ""
    min_transformers: str = ""
    # features (keys of NOT_EXACT) this family's chunk loss and data path are not yet tested against:
    # refused before start, one line each, until they are made exact
    not_exact: tuple[str, ...] = ()
    # modules HF's forward never reads (no gradient ever reaches them, so AdamW would keep no state for
    # them and a resumed run would miss it): frozen at build, still saved and exported as loaded
    never_trained: tuple[str, ...] = ()
    # the whole model the family's checkpoints may hold it in (Omni: thinker, talker, vocoder); None: alone
    whole: Whole | None = None
    # fused parameters the family's published checkpoints store transposed from transformers 5.x's modules
    # (Qwen3-VL-MoE's experts: [E, hidden, 2·inter] and [E, inter, hidden] on disk, [E, out, in] held): 5.x
    # transposes them on load (its conversion mapping) and writes its own layout on save; vLLM and 4.57 read Qwen's
    checkpoint_transposed: tuple[str, ...] = ()
    # why vLLM (grpo.rollout_engine, train.eval_engine, qwenkit eval --engine) cannot run the family; "" = it can
    vllm_refusal: str = ""
    # embedding tables sharded on their columns over every rank, outside FSDP, never gathered whole: looked up by
    # an exchange of rows (qwenkit.distributed.columns; Qwen4-Exp's n-gram tables, ~76 GiB each in the real checkpoint)
    column_sharded: tuple[str, ...] = ()

    def holds(self, model_type: str | None) -> bool:
        """Whether a checkpoint of ``model_type`` holds this family's model: its own, or its whole's."""
        return model_type == self.model_type or (self.whole is not None and model_type == self.whole.model_type)

    def checkpoint_tensor(self, name: str, tensor):
        """``tensor``, parameter ``name`` as this transformers holds it, in the layout of the family's checkpoints."""
        if self.checkpoint_transposed and name.endswith(self.checkpoint_transposed):
            if int(importlib.metadata.version("transformers").split(".")[0]) >= 5:  # 4.57 holds Qwen's layout
                return tensor.transpose(1, 2)
        return tensor

    def load(self, what: str):
        """The class (or function) an import path of this entry names."""
        return _imported(getattr(self, what))

    def unavailable(self) -> str | None:
        """Why this transformers install cannot build the family (4.57 has no Qwen3.5, 5.22 no Qwen4-Exp), or None."""
        module = f"transformers.models.{self.hf_module or self.model_type}"
        version = importlib.metadata.version("transformers")
        floor = self.min_transformers
        if importlib.util.find_spec(module) is not None and (not floor or _release(version) >= _release(floor)):
            return None
        return (f"model.name={self.name} needs transformers {f'>= {floor}' if floor else '5.x'} ({module}); "
                f"transformers {version} is installed and has no such model, or another module tree")  # fmt: skip

    def part_of(self, name: str) -> str | None:
        """The part (of :func:`qwenkit.model.families.build.parameter_counts`) a parameter or module path belongs to, or None."""
        for part, prefixes in self.parts:
            if any(prefix_match(name, p) for p in prefixes):
                return part
        return None

    def in_tower(self, name: str, tower: str) -> bool:
        return any(prefix_match(name, p) for p in self.lora_towers[tower])

    def lora_excluded(self, name: str) -> bool:
        return any(prefix_match(name, p) for p in self.lora_exclude)

    def problems(self, cfg, path: str | Path | None = None) -> list[str]:
        """What of ``cfg`` this family cannot run, one line each naming the key; empty: all is well.

        Generic over the entry's fields: each layer kind of :attr:`mixers` against sequence
        parallelism, packing and the attention implementation (:data:`MIXERS`), ``model.fused_ops``
        against the entry's ``fused_ops``, the router's aux loss with sequence parallelism (read from
        ``path``'s ``config.json``, the checkpoint's setting; skipped without ``path``), and expert
        parallelism against the entry's ``experts`` (and the checkpoint's expert count).
        """
        problems, sp, attn = [], cfg.parallel.sp_size, cfg.model.attn_implementation
        for kind in self.mixers:
            mixer = MIXERS[kind]
            if sp > 1 and not mixer.sequence_parallel:
                problems.append(
                    f"parallel.sp_size={sp}: {self.name}'s {kind} layers cannot run sequence parallel (Ulysses "
                    "splits attention only; they would see one rank's slice of the sequence); use parallel.sp_size=1"
                )
            if cfg.data.packing and not mixer.packing:
                problems.append(
                    f"data.packing=true: {self.name}'s {kind} layers cannot keep a packed row's samples apart; "
                    "use data.packing=false"
                )
            if attn not in mixer.attn_implementations:
                problems.append(
                    f"model.attn_implementation={attn!r}: {self.name}'s {kind} layers run with "
                    f"{', '.join(mixer.attn_implementations)}"
                )
        mtp = cfg.model.mtp
        if mtp.train and not self.mtp_layers:
            problems.append(f"model.mtp.train: {self.name} has no multi-token-prediction layer (Qwen3.5's "
                            "families have one); use model.mtp.train=false")  # fmt: skip
        elif mtp.train and mtp.layers > self.mtp_layers:
            problems.append(f"model.mtp.layers={mtp.layers}: {self.name}'s checkpoints hold {self.mtp_layers}")
        elif mtp.train and cfg.lora.r > 0 and "mtp" not in self.lora_towers:
            problems.append(f"model.mtp.train: lora.r={cfg.lora.r} would freeze {self.name}'s MTP layer (its entry "
                            "gives LoRA no adapters there); use lora.r=0 or model.mtp.train=false")  # fmt: skip
        ops = cfg.model.fused_ops
        unfit = [op for op in ops if op not in self.fused_ops] if isinstance(ops, (list, tuple)) else []
        if unfit:
            problems.append(
                f"model.fused_ops: {', '.join(unfit)} do not fit {self.name} (its entry patches "
                f"{', '.join(self.fused_ops)}); leave them out, or use auto"
            )
        if path is not None and sp > 1 and self.aux_loss:
            problem = aux_loss_sp_problem(self, path, sp)
            if problem:
                problems.append(problem)
        vllm = [k for k, v in (("grpo.rollout_engine", cfg.grpo.rollout_engine), ("train.eval_engine", cfg.train.eval_engine))
                if v == "vllm"]  # fmt: skip
        if vllm and self.vllm_refusal:
            problems.append(f"{' and '.join(f'{k}=vllm' for k in vllm)}: {self.vllm_refusal}; use the hf engine")
        if cfg.train.objective == "grpo" and cfg.grpo.routing_replay:
            problem = routing_replay_problem(self)
            if problem:
                problems.append(problem)
        if cfg.parallel.cpu_offload and self.column_sharded:
            # distributed/columns.py keeps the tables outside FSDP2, so its CPUOffloadPolicy never moves them
            problems.append(f"parallel.cpu_offload=true: {self.name}'s column-sharded tables ({', '.join(self.column_sharded)}) "
                            "stay outside FSDP2, whose offload does not reach them; use parallel.cpu_offload=false")  # fmt: skip
        if cfg.parallel.ep_size > 1:
            problem = expert_parallel_problem(self, path, cfg.parallel.ep_size)
            if problem:
                problems.append(problem)
        for feature in self.not_exact:
            key, on = NOT_EXACT[feature]
            if on(cfg):
                problems.append(
                    f"{key(cfg)}: {self.name}'s {feature} is not made exact yet (its chunk loss equals HF's "
                    f"for SFT without it); turn it off"
                )
        return problems
