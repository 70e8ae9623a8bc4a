"""Model families: one entry per family holds everything that differs between them.

:data:`FAMILIES` is the one list of families: ``model.name``'s allowed values
(:data:`qwenkit.config.MODEL_NAMES`) and the tests' ``EVERY_FAMILY`` are read from it, and no
module outside ``qwenkit/model/`` spells a family's name (``tests/test_family.py``). A
checkpoint's ``config.json`` names its own ``model_type``, and :func:`resolve` refuses a
directory of another family before any rank starts. Everything else in qwenkit asks the entry
instead of testing the family: the classes (HF's and qwenkit's chunk-loss subclass, by import
path), the module paths that the parameter counts, ``model.freeze`` and LoRA name (matched with
:func:`qwenkit.model.modules.prefix_match`), the shard and recompute units an unset
``parallel.shard_patterns`` / ``parallel.recompute: auto`` mean, the fused ops that apply, the
vision patch geometry the data pipeline resizes to, the chat template and video rule, the tiny
default's config builder, and what the family cannot run (:meth:`Family.problems`, asked by the
launcher before any process starts and by every rank).

Light on purpose: the standard library and :mod:`qwenkit.model.modules` only, so the config
leaf may read the names here (docs/ARCHITECTURE.md, the floors).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from qwenkit.model.family_limits import MIXERS, NOT_EXACT, Mixer, aux_loss_sp_problem, expert_parallel_problem
from qwenkit.model.modules import prefix_match

__all__ = ["FAMILIES", "MIXERS", "NOT_EXACT", "Family", "Mixer"]


@dataclass(frozen=True)
class Family:
    name: str  # model.name
    model_type: str  # config.json's model_type
    hf_class: str  # transformers' class, "module:attr"
    subclass: str  # qwenkit's chunk-loss subclass, "module:attr"
    tiny_config: str  # the tiny default's config builder, "module:attr"
    # (parameter-count part, module-path prefixes), first match wins; model.freeze names these paths too
    parts: tuple[tuple[str, tuple[str, ...]], ...]
    lora_towers: dict[str, tuple[str, ...]]  # "text" / "vision": module-path prefixes LoRA adapts
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
    aux_loss: bool = False  # the router's load-balancing loss joins the training loss (MoE)
    mixers: tuple[str, ...] = ("attention",)  # the text decoder's sequence-mixing layer kinds (MIXERS)
    # the boxes the family writes (grounding): pixels of the resized image (Qwen2.5-VL) or per_mille,
    # 0-1000 of the width and height (Qwen3-VL); the iou reward (qwenkit.engine.objectives.rewards) reads it
    box_units: str = "pixels"
    # the routed-experts modules (fused 3-D gate_up_proj / down_proj, HF's forward(hidden, top_k_index,
    # top_k_weights)) that parallel.ep_size splits across ranks (qwenkit.distributed.expert); () = a dense family
    experts: tuple[str, ...] = ()
    # linears of the towers LoRA never adapts, not even with all-linear: a MoE's router (a linear in
    # transformers 4.57, a parameter in 5.x: adapted in one and not the other, routing would differ by version)
    lora_exclude: tuple[str, ...] = ()
    # multi-token-prediction layers the family's checkpoints ship as mtp.* (Qwen3.5): HF's class does not
    # load them, export keeps them (qwenkit.engine.checkpoints.export.keep_mtp), the tiny checkpoint writes them
    mtp_layers: int = 0
    # the audio placeholder tokens (start, pad, end) of a family that hears (Omni); () = no audio tower
    audio_tokens: tuple[str, ...] = ()
    # the transformers submodule that holds the family (default: model_type) and the oldest major version
    # whose module tree the subclass fits (4.57's Omni thinker has no multimodal backbone under ``model``)
    hf_module: str = ""
    min_transformers: int = 4
    # features (keys of NOT_EXACT) this family's chunk loss and data path are not yet tested against:
    # refused before start, one line each, until they are made exact
    not_exact: tuple[str, ...] = ()
    # modules HF's forward never reads (no gradient ever reaches them, so AdamW would keep no state for
    # them and a resumed run would miss it): frozen at build, still saved and exported as loaded
    never_trained: tuple[str, ...] = ()
    # fused parameters the family's published checkpoints store transposed from transformers 5.x's modules
    # (Qwen3-VL-MoE's experts: [E, hidden, 2·inter] and [E, inter, hidden] on disk, [E, out, in] held): 5.x
    # transposes them on load (its conversion mapping) and writes its own layout on save; vLLM and 4.57 read Qwen's
    checkpoint_transposed: tuple[str, ...] = ()
    # why vLLM (grpo.rollout_engine, train.eval_engine, qwenkit eval --engine) cannot run the family; "" = it can
    vllm_refusal: str = ""

    def checkpoint_tensor(self, name: str, tensor):
        """``tensor``, parameter ``name`` as this transformers holds it, in the layout of the family's checkpoints."""
        if self.checkpoint_transposed and name.endswith(self.checkpoint_transposed):
            if int(importlib.metadata.version("transformers").split(".")[0]) >= 5:  # 4.57 holds Qwen's layout
                return tensor.transpose(1, 2)
        return tensor

    def load(self, what: str):
        """The class (or function) an import path of this entry names."""
        module, _, attr = getattr(self, what).partition(":")
        return getattr(importlib.import_module(module), attr)

    def unavailable(self) -> str | None:
        """Why this transformers install cannot build the family (4.57 has no Qwen3.5), or None."""
        module = f"transformers.models.{self.hf_module or self.model_type}"
        version = importlib.metadata.version("transformers")
        if importlib.util.find_spec(module) is not None and int(version.split(".")[0]) >= self.min_transformers:
            return None
        return (f"model.name={self.name} needs transformers 5.x ({module}); transformers "
                f"{version} is installed and has no such model, or another module tree")  # fmt: skip

    def part_of(self, name: str) -> str | None:
        """The part (of :func:`qwenkit.model.registry.parameter_counts`) a parameter or module path belongs to, or None."""
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
        ops = cfg.model.fused_ops
        unfit = [op for op in ops if op not in self.fused_ops] if isinstance(ops, (list, tuple)) else []
        if unfit:
            problems.append(
                f"model.fused_ops: {', '.join(unfit)} do not fit {self.name} (its entry patches "
                f"{', '.join(self.fused_ops)}); leave them out, or use auto"
            )
        if path is not None and sp > 1 and self.aux_loss:
            problem = aux_loss_sp_problem(path, sp)
            if problem:
                problems.append(problem)
        vllm = [k for k, v in (("grpo.rollout_engine", cfg.grpo.rollout_engine), ("train.eval_engine", cfg.train.eval_engine))
                if v == "vllm"]  # fmt: skip
        if vllm and self.vllm_refusal:
            problems.append(f"{' and '.join(f'{k}=vllm' for k in vllm)}: {self.vllm_refusal}; use the hf engine")
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


_TEXT = ("model.language_model",)
_LAYERS = ("model.language_model.layers.*",)
_SHARD = ("model.visual.blocks.*", "model.visual.merger", "model.language_model.embed_tokens", *_LAYERS, "lm_head")
_QWEN3_PARTS = (
    ("vision blocks", ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks")),
    ("merger", ("model.visual.merger",)),
    ("deepstack mergers", ("model.visual.deepstack_merger_list",)),
    ("language model", _TEXT),
    ("lm_head", ("lm_head",)),
)
# Qwen3-VL's template writes no system turn unless given one; its video processor samples and times frames
_QWEN3_DATA = dict(
    video_timestamps=True,
    chat_template="qwenkit.model.processor:QWEN3_VL_CHAT_TEMPLATE",
    default_system=None,
    video_rule="Qwen3VLVideoProcessor",
    box_units="per_mille",
)
_QWEN3_SHARD = (*_SHARD[:2], "model.visual.deepstack_merger_list.*", *_SHARD[2:])
# Qwen3.5: Qwen3-VL's vision tower without DeepStack; three of four text layers are linear attention
_QWEN3_5_PARTS = (
    ("vision blocks", ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks")),
    ("merger", ("model.visual.merger",)),
    ("language model", _TEXT),
    ("lm_head", ("lm_head",)),
)
# Qwen3.5 templates as Qwen3-VL does, plus the thinking block of the replies after the last user turn
_QWEN3_5_DATA = {**_QWEN3_DATA, "chat_template": "qwenkit.model.processor:QWEN3_5_CHAT_TEMPLATE", "think_tags": True}
# what vLLM 0.32 cannot do for a family (Family.vllm_refusal; docs/TRAINING.md has the evidence)
_VLLM_MOE = ("vLLM 0.32 (CPU) loads this MoE checkpoint (its replies agree with the kit's), but its in-place reload of "
             "the fused experts, which every weight push uses, leaves wrong outputs (Qwen3-VL-MoE: log-probs 0.07 off "
             "after reloading the checkpoint's own expert tensors)")  # fmt: skip

# what the Omni thinkers' chunk loss = HF is not yet tested with: refused before start
_OMNI_NOT_EXACT = ("packing", "sequence parallelism", "LoRA", "DPO", "GRPO")

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="qwen2_5_vl",
            model_type="qwen2_5_vl",
            hf_class="transformers:Qwen2_5_VLForConditionalGeneration",
            subclass="qwenkit.model.qwen2_5_vl:QwenkitQwen2_5_VL",
            tiny_config="qwenkit.model.tiny_configs:qwen2_5_vl_config",
            parts=(
                ("vision blocks", ("model.visual.patch_embed", "model.visual.blocks")),
                ("merger", ("model.visual.merger",)),
                ("language model", _TEXT),
                ("lm_head", ("lm_head",)),
            ),
            lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",)},
            shard_units=_SHARD,
            recompute_units=_LAYERS,
            fused_ops=("rms_norm", "vision_rope", "swiglu"),
            patch_size=14,
        ),
        Family(
            name="qwen3_vl",
            model_type="qwen3_vl",
            hf_class="transformers:Qwen3VLForConditionalGeneration",
            subclass="qwenkit.model.qwen3_vl:QwenkitQwen3VL",
            tiny_config="qwenkit.model.tiny_configs:qwen3_vl_config",
            parts=_QWEN3_PARTS,
            lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",)},
            shard_units=_QWEN3_SHARD,
            recompute_units=_LAYERS,
            # the vision blocks are LayerNorm + GELU: only the text RMSNorms (q/k norms too) and SwiGLU
            fused_ops=("rms_norm", "swiglu"),
            patch_size=16,
            **_QWEN3_DATA,
        ),
        Family(
            name="qwen3_vl_moe",
            model_type="qwen3_vl_moe",
            hf_class="transformers:Qwen3VLMoeForConditionalGeneration",
            subclass="qwenkit.model.qwen3_vl:QwenkitQwen3VLMoe",
            tiny_config="qwenkit.model.tiny_configs:qwen3_vl_moe_config",
            parts=(*_QWEN3_PARTS[:3], ("experts", ("model.language_model.layers.*.mlp.experts",)), *_QWEN3_PARTS[3:]),
            lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",)},
            shard_units=_QWEN3_SHARD,
            recompute_units=_LAYERS,
            lora_exclude=("model.language_model.layers.*.mlp.gate",),
            fused_ops=("rms_norm",),  # the sparse MoE block has fused expert weights, no SwiGLU linears
            patch_size=16,
            **_QWEN3_DATA,
            aux_loss=True,
            experts=("model.language_model.layers.*.mlp.experts",),
            checkpoint_transposed=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
            vllm_refusal=_VLLM_MOE,
        ),
        Family(
            name="qwen3_5",
            model_type="qwen3_5",
            hf_class="transformers:Qwen3_5ForConditionalGeneration",
            subclass="qwenkit.model.qwen3_5:QwenkitQwen3_5",
            tiny_config="qwenkit.model.tiny_configs:qwen3_5_config",
            parts=_QWEN3_5_PARTS,
            lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",)},
            shard_units=_SHARD,
            recompute_units=_LAYERS,
            # the text RMSNorms scale by (1 + weight) and the linear attention's norm is gated: no kernel
            # here matches them, so they stay HF's
            fused_ops=("swiglu",),
            patch_size=16,
            **_QWEN3_5_DATA,
            mixers=("attention", "linear_attention"),
            mtp_layers=1,
        ),
        Family(
            name="qwen3_5_moe",
            model_type="qwen3_5_moe",
            hf_class="transformers:Qwen3_5MoeForConditionalGeneration",
            subclass="qwenkit.model.qwen3_5:QwenkitQwen3_5Moe",
            tiny_config="qwenkit.model.tiny_configs:qwen3_5_moe_config",
            parts=(*_QWEN3_5_PARTS[:2], ("experts", ("model.language_model.layers.*.mlp.experts",)), *_QWEN3_5_PARTS[2:]),
            lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",)},
            shard_units=_SHARD,
            recompute_units=_LAYERS,
            # all-linear adapts attention, linear attention and the shared expert: the routed experts are fused
            # 3-D parameters (no linears); the router and the shared expert's gate are never adapted
            lora_exclude=("model.language_model.layers.*.mlp.gate", "model.language_model.layers.*.mlp.shared_expert_gate"),
            fused_ops=("swiglu",),  # the shared expert's MLP; the routed experts are fused 3-D parameters
            patch_size=16,
            **_QWEN3_5_DATA,
            mixers=("attention", "linear_attention"),
            mtp_layers=1,
            aux_loss=True,
            experts=("model.language_model.layers.*.mlp.experts",),  # the shared expert stays outside: a dense MLP
            vllm_refusal=_VLLM_MOE,
        ),
        # Qwen2.5-Omni's thinker (the model trained; talker and token2wav are not loaded): Qwen2.5-VL's
        # vision tower and decoder plus a Whisper-style audio tower under model.audio_tower
        Family(
            name="qwen2_5_omni",
            model_type="qwen2_5_omni_thinker",
            hf_class="transformers:Qwen2_5OmniThinkerForConditionalGeneration",
            subclass="qwenkit.model.omni:QwenkitQwen2_5OmniThinker",
            tiny_config="qwenkit.model.tiny_configs:qwen2_5_omni_config",
            parts=(
                ("audio tower", ("model.audio_tower",)),
                ("vision blocks", ("model.visual.patch_embed", "model.visual.blocks")),
                ("merger", ("model.visual.merger",)),
                ("language model", _TEXT),
                ("lm_head", ("lm_head",)),
            ),
            lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",)},
            shard_units=_SHARD,
            recompute_units=_LAYERS,
            fused_ops=("rms_norm", "vision_rope", "swiglu"),  # Qwen2.5-VL's modules under other class names
            patch_size=14,
            audio_tokens=("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"),
            hf_module="qwen2_5_omni",
            never_trained=("model.audio_tower.audio_bos_eos_token",),
            min_transformers=5,
            not_exact=_OMNI_NOT_EXACT,
        ),
        # Qwen3-Omni's thinker: Qwen3-VL-MoE's DeepStack tower and MoE decoder plus its audio tower
        Family(
            name="qwen3_omni_moe",
            model_type="qwen3_omni_moe_thinker",
            hf_class="transformers:Qwen3OmniMoeThinkerForConditionalGeneration",
            subclass="qwenkit.model.omni:QwenkitQwen3OmniMoeThinker",
            tiny_config="qwenkit.model.tiny_configs:qwen3_omni_moe_config",
            parts=(
                ("audio tower", ("model.audio_tower",)),
                *_QWEN3_PARTS[:2],
                ("deepstack mergers", ("model.visual.merger_list",)),
                ("experts", ("model.language_model.layers.*.mlp.experts",)),
                *_QWEN3_PARTS[3:],
            ),
            lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",)},
            shard_units=(*_SHARD[:2], "model.visual.merger_list.*", *_SHARD[2:]),
            recompute_units=_LAYERS,
            lora_exclude=("model.language_model.layers.*.mlp.gate",),
            fused_ops=("rms_norm",),
            patch_size=16,
            # Qwen3's template; videos as Qwen2.5-Omni's: one span, timed by video_second_per_grid
            **{**_QWEN3_DATA, "video_timestamps": False, "video_rule": "Qwen2VLVideoProcessor"},
            aux_loss=True,
            experts=("model.language_model.layers.*.mlp.experts",),
            audio_tokens=("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"),
            hf_module="qwen3_omni_moe",
            min_transformers=5,
            not_exact=(*_OMNI_NOT_EXACT, "expert parallelism"),
        ),
    )
}
TINY_DEFAULT = "qwen2_5_vl"  # model.path=tiny with model.name=auto builds this family's tiny checkpoint


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model.name={name!r} is not a known family; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def of_config(config) -> Family:
    """The family of a model config (an HF model's ``config``), by its ``model_type``."""
    for family in FAMILIES.values():
        if family.model_type == config.model_type:
            return family
    raise ValueError(f"model_type={config.model_type!r} is no qwenkit family; known: {', '.join(FAMILIES)}")


def of_model(model) -> Family:
    return of_config(model.config)


def _model_type(path: str | Path) -> str | None:
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise ValueError(f"model.path={str(path)!r}: config.json unreadable ({e})") from None


def of_directory(path: str | Path, default: str = TINY_DEFAULT) -> Family:
    """The family of a model directory: its ``config.json``, a peft adapter directory's base model's
    (``adapter_config.json``'s ``base_model_name_or_path``), else ``default`` (processor files alone)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return resolve("auto", path)
    adapter = path / "adapter_config.json"
    if adapter.is_file():
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        if base and (Path(base) / "config.json").is_file():
            return resolve("auto", base)
    return get(default)


def resolve(name: str, path: str | Path) -> Family:
    """``model.name``'s entry, or (``auto``) the one of the checkpoint's ``config.json`` ``model_type``;
    a name the checkpoint disagrees with is refused (before any rank starts: the launcher builds
    the module tree on meta through this)."""
    model_type = _model_type(path)
    by_type = [f for f in FAMILIES.values() if f.model_type == model_type]
    if name == "auto":
        if not by_type:
            raise ValueError(
                f"model.path={str(path)!r}: model_type={model_type!r} is no qwenkit family; known: {', '.join(FAMILIES)}"
            )
        return by_type[0]
    family = get(name)
    if family.model_type != model_type:
        hint = f"model.name={by_type[0].name} or auto" if by_type else "a checkpoint of that family"
        raise ValueError(f"model.name={name!r} but {path}/config.json has model_type={model_type!r}: use {hint}")
    return family


def entry_problems(name: str, path: str | Path) -> list[str]:
    """What the family entry of ``model.name`` / ``model.path`` says it cannot run before anything is
    built (the tiny checkpoint included): a transformers without the family (Qwen3.5 on 4.57).
    ``auto`` with ``tiny`` is the tiny default, which every version has."""
    if name != "auto":
        family = get(name)
    elif (Path(path).expanduser() / "config.json").is_file():
        try:
            family = resolve("auto", Path(path).expanduser())
        except ValueError as e:  # a model_type of no family
            return [str(e)]
    else:
        return []
    return [p for p in (family.unavailable(),) if p]


def units(model, key: str, value) -> list[str]:
    """The module patterns of ``parallel.<key>`` (``shard_patterns`` or ``recompute``) for ``model``:
    ``auto`` means its family's ``shard_units`` / ``recompute_units``."""
    if value != "auto":
        return list(value)
    family = of_model(model)
    return list(family.shard_units if key == "shard_patterns" else family.recompute_units)


def problems(cfg, path: str | Path) -> list[str]:
    """:meth:`Family.problems` of the family ``cfg`` trains (``model.name``, or the checkpoint's at
    ``path``); the launcher asks it before any process starts, and every rank before it builds the
    model. A checkpoint of no family, or of another, is :func:`resolve`'s to refuse: nothing here."""
    try:
        family = resolve(cfg.model.name, path)
    except ValueError:
        return []
    return family.problems(cfg, path)
