"""A checkpoint as a Hugging Face model: gathered in one process, written as an HF directory.

:func:`load_hf` reads every DCP shard into HF's own class of the family (``Qwen2_5_VLForConditionalGeneration``, ``Qwen3VLForConditionalGeneration``, the
class users deploy), without a process group; :func:`export` saves it with ``save_pretrained``,
copies the base model's tokenizer and processor files beside it, and writes the run's image
bounds and video sampling (``data.*``) into the processor files (:func:`write_run_processing`),
so HF's processor loaded from the export resizes exactly as training did; the run's resolved config
goes beside them (:data:`RUN_CONFIG`: ``qwenkit eval`` of the export evaluates as the run did). A base checkpoint's
multi-token-prediction tensors (Qwen3.5's ``mtp.*``, which HF's class does not load) go into the
export unchanged (:func:`keep_mtp`). A run started from a whole Omni checkpoint (thinker, talker, vocoder)
trained its thinker: the export is the whole again, the trained thinker beside the base's other tensors
byte for byte (:func:`keep_whole`), which HF's class of the whole loads.

The export is written under a temporary name beside the target and renamed into place: a
failed export leaves no half directory. The target must be new or empty; ``overwrite``
replaces a previous export (a directory with ``config.json``), never any other folder, and never
the run's own output_dir or its checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp

from qwenkit.config import DTYPES, write_config
from qwenkit.data import video
from qwenkit.distributed.meta import build_on_meta, set_buffer, tied_groups
from qwenkit.engine.checkpoints.dcp import CheckpointError, resolve
from qwenkit.model import lora
from qwenkit.model.families import mtp
from qwenkit.model.families.spec import ModelSpec, of_run

log = logging.getLogger(__name__)


# Non-weight files of an HF checkpoint directory that the export copies from the base model.
PROCESSOR_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
    "added_tokens.json", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "video_preprocessor_config.json", "processor_config.json", "generation_config.json",
)


# what a video processor config takes from the image processor's (one vision tower reads both)
VIDEO_SHARED_KEYS = (
    "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor",
    "do_rescale", "do_normalize", "do_convert_rgb", "resample",
)


class ExportError(ValueError):
    """An export target that would mix or lose files; the message names it and the way out."""


def export(checkpoint: str | Path, out: str | Path, cfg, merge: bool = False, overwrite: bool = False) -> Path:
    """Write a checkpoint's model as an HF directory (safetensors, config, processor files).

    Runs in one process without a process group (see :func:`load_hf`); ``save_pretrained``
    writes HF's own key layout, so ``from_pretrained`` loads it back. A LoRA run (``lora.r >
    0``) writes peft's adapter directory (``adapter_config.json`` naming the base model,
    ``adapter_model.safetensors`` in peft's key names), which ``PeftModel.from_pretrained`` on
    the base model loads; ``merge``: a full HF directory with the adapters merged instead.
    """
    ckpt = resolve(checkpoint)
    out = Path(out)
    check_target(out, ckpt, overwrite)
    spec = of_run(cfg.model)  # the family, once: the export's class and its processing files
    base = spec.path
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-export-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    adapter = cfg.lora.r > 0 and not merge
    model = load_peft(ckpt, cfg, spec) if adapter else load_hf(ckpt, cfg, spec)
    # model.mtp.train: the trained layer, under the checkpoint's names (a LoRA run's with its adapters merged)
    trained = take_mtp(model) if cfg.lora.r > 0 else trained_mtp(ckpt)
    model.save_pretrained(tmp)
    if trained:
        keep_mtp(base, tmp, trained)
        log.info("export writes the trained multi-token-prediction layer: %d mtp.* tensors", len(trained))
    elif spec.whole and not adapter:  # an adapter directory: the base's files stay the base's
        kept = keep_whole(spec, tmp)
        log.info("export writes the whole model of %s: the trained %s beside its %d other tensors, unchanged",
                 base, spec.family.whole.part, kept)  # fmt: skip
    elif not adapter and (kept := keep_mtp(base, tmp)):
        log.info("export keeps the base model's multi-token-prediction layer: %d mtp.* tensors of %s, "
                 "unchanged (not trained; vLLM and SGLang use them for speculative decoding)", kept, base)  # fmt: skip
    for name in PROCESSOR_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, tmp / name)
    write_run_processing(tmp, cfg.data, spec.family)
    write_config(cfg, tmp, RUN_CONFIG)
    if out.exists():  # a previous export, and overwrite was asked for (check_target)
        old = out.parent / f".old-export-{out.name}-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    log.debug("exported %s to %s", ckpt, out)
    return out


RUN_CONFIG = "qwenkit_config.yaml"  # in an export: the run's resolved config (its eval set, metrics, sampling)
MTP_PREFIX = mtp.PREFIX  # Qwen3.5's multi-token-prediction layer: in the checkpoints, not in HF's class
MTP_FILE = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"


def trained_mtp(ckpt: Path) -> dict:
    """The ``mtp.*`` tensors a ``model.mtp.train`` run saved in its checkpoint (full, CPU); empty: none."""
    import torch

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    prefix = "model." + MTP_PREFIX
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if k.startswith(prefix)}
    if not tensors:
        return {}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load({"model": {k[len("model.") :]: v for k, v in tensors.items()}}, checkpoint_id=str(ckpt), no_dist=True)
    return {k[len("model.") :]: v for k, v in tensors.items()}


def take_mtp(model) -> dict:
    """The MTP layer of a LoRA run loaded by :func:`load_peft` (a ``model.mtp.train`` one), its adapters merged,
    under the checkpoint's names (``mtp.fc.weight``), taken off ``model`` (and off peft's targets), so that
    ``save_pretrained`` writes HF's class's own keys or adapters; ``{}``: no MTP layer."""
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(hf, "mtp", None) is None:
        return {}
    layer = lora.merge_in_place(hf.mtp)
    del hf.mtp
    for config in getattr(model, "peft_config", {}).values():  # the adapter directory adapts HF's class alone
        config.target_modules = {t for t in config.target_modules if not t.startswith(MTP_PREFIX)}
    return {MTP_PREFIX + k: v.detach().clone() for k, v in layer.state_dict().items()}


def keep_mtp(base: Path, out: Path, trained: dict | None = None) -> int:
    """Copy the base checkpoint's ``mtp.*`` tensors, unchanged, into the export at ``out``; returns how many.
    ``trained``: those tensors as a ``model.mtp.train`` run left them, written instead.

    HF's class does not load them (``_keys_to_ignore_on_load_unexpected``), so ``save_pretrained``
    drops them; they go to their own file, listed in the export's ``model.safetensors.index.json``
    (written when ``save_pretrained`` wrote a single file), which vLLM and SGLang read. Tensors are
    read one at a time (``safe_open``), never the whole base. A LoRA run's adapter directory (no
    weights of HF's class to index beside) gets the trained layer's file alone, merged: peft's file cannot hold
    adapters of a layer HF's class does not have.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = base / INDEX
    if index.is_file():
        files = sorted({f for k, f in json.loads(index.read_text())["weight_map"].items() if k.startswith(MTP_PREFIX)})
    else:
        files = [p.name for p in sorted(base.glob("*.safetensors"))]
    tensors = {}
    for name in [] if trained else files:
        with safe_open(base / name, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(MTP_PREFIX)})
    tensors = trained or tensors
    if not tensors:
        return 0
    save_file(tensors, out / MTP_FILE, metadata={"format": "pt"})
    if not (out / INDEX).is_file() and not (out / "model.safetensors").is_file():  # an adapter directory
        return len(tensors)
    if (out / INDEX).is_file():
        written = json.loads((out / INDEX).read_text())
    else:  # one file: index it, so that readers of the index find both
        with safe_open(out / "model.safetensors", framework="pt") as f:
            keys = list(f.keys())
        size = (out / "model.safetensors").stat().st_size
        written = {"metadata": {"total_size": size}, "weight_map": dict.fromkeys(keys, "model.safetensors")}
    written["weight_map"].update(dict.fromkeys(tensors, MTP_FILE))
    written["metadata"]["total_size"] = written["metadata"].get("total_size", 0) + sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    (out / INDEX).write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    return len(tensors)


def keep_whole(spec: ModelSpec, out: Path) -> int:
    """Put the trained part at ``out`` (what ``save_pretrained`` wrote of a thinker) back into the whole
    model of ``spec``'s checkpoint (a full Omni one); returns how many of the whole's other tensors it carries.

    The part's tensors get the whole's prefix where they lack it (``thinker.``: HF's class of the whole saves
    its part's keys as the part's own class does, under that prefix); every other tensor of the base (talker, token2wav or
    code2wav) is copied byte for byte, one base file at a time, into ``whole-<base file name>``; the index
    lists both. The base's ``config.json`` (the whole's), ``generation_config.json`` and the files HF's
    class of the whole reads beside the weights (:attr:`qwenkit.model.families.entry.Whole.files`: Qwen2.5-Omni's
    speakers) replace the part's, so that HF's class of the whole loads the export with ``from_pretrained``.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    whole, base = spec.family.whole, spec.path
    weight_map, size = {}, 0
    part_files = sorted(set(json.loads((out / INDEX).read_text())["weight_map"].values())) if (out / INDEX).is_file() \
        else ["model.safetensors"]  # fmt: skip
    for name in part_files:  # one of the part's files at a time
        # a part loaded from the whole by from_pretrained (a LoRA run's merge) saves its keys prefixed already
        tensors = {k if k.startswith(whole.prefix) else whole.prefix + k: v for k, v in load_file(out / name).items()}
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        size += sum(t.numel() * t.element_size() for t in tensors.values())
    base_files = sorted(set(json.loads((base / INDEX).read_text())["weight_map"].values())) if (base / INDEX).is_file() \
        else [p.name for p in sorted(base.glob("*.safetensors"))]  # fmt: skip
    kept = 0
    for name in base_files:
        with safe_open(base / name, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(whole.prefix)}
        if tensors:
            save_file(tensors, out / f"whole-{name}", metadata={"format": "pt"})
            weight_map |= dict.fromkeys(tensors, f"whole-{name}")
            kept += len(tensors)
            size += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2,
                                        sort_keys=True) + "\n")  # fmt: skip
    for name in ("config.json", "generation_config.json", *whole.files):
        if (base / name).is_file():
            shutil.copy2(base / name, out / name)
    return kept


def load_peft(checkpoint: str | Path, cfg, spec: ModelSpec):
    """A LoRA run's checkpoint as peft's ``PeftModel`` on HF's class (base weights from ``model.path``,
    ``spec``: :func:`qwenkit.model.families.spec.of_run` of ``cfg.model``).

    peft builds its own adapters (same targets, rank, saved modules) on the base model; the
    checkpoint's trained tensors are then read into them by name: qwenkit's keys are the
    PeftModel's without ``base_model.model.`` and with a saved module's ``modules_to_save.default``
    segment dropped (qwenkit trains the module itself, peft a copy of it).
    """
    from peft import get_peft_model

    ckpt = resolve(checkpoint)
    base = spec.path
    hf_class = spec.family.load("hf_class")
    hf = hf_class.from_pretrained(base, config=spec.hf_config(), dtype=DTYPES[cfg.model.dtype], local_files_only=True)
    if cfg.model.mtp.train:  # the trained MTP layer (HF's class has none): the base's weights, adapted as in training
        mtp.attach(hf, cfg.model.mtp.layers or spec.family.mtp_layers, cfg.model.mtp.loss_weight)
        mtp.load_from_checkpoint(hf, base)
    config = lora.peft_config(cfg.lora, hf, modules_to_save=True)
    config.base_model_name_or_path = str(base)
    peft_model = get_peft_model(hf, config)
    saved = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    wanted, missing = {}, []
    for name, param in peft_model.named_parameters():
        if not param.requires_grad:
            continue
        key = name.removeprefix("base_model.model.").replace(f".modules_to_save.{lora.ADAPTER}.", ".")
        if f"model.{key}" in saved:
            wanted[key] = param.data
        else:
            missing.append(key)
    if missing:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks trained tensors: {', '.join(missing[:5])}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load({"model": wanted}, checkpoint_id=str(ckpt), no_dist=True)
    return peft_model
def check_target(out: Path, ckpt: Path, overwrite: bool) -> None:
    """Raise :class:`ExportError` unless ``out`` may receive the export of checkpoint ``ckpt``."""
    target = out.resolve()
    root = ckpt.resolve().parent  # <output_dir>/checkpoints
    if target == root.parent and root.name == "checkpoints":
        raise ExportError(
            f"export target {str(out)!r} is the run's own output_dir: `qwenkit eval` would then take the run "
            "for an export; export to a directory of its own (e.g. RUN/hf)"
        )
    if target == root or root in target.parents:
        raise ExportError(f"export target {str(out)!r} is inside the run's checkpoints ({root}); choose another directory")
    if out.exists() and not out.is_dir():
        raise ExportError(f"export target {str(out)!r} is a file, not a directory")
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ExportError(
            f"export target {str(out)!r} is not empty; pass --overwrite to replace a previous export there, "
            "or give a new directory"
        )
    if not any((out / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise ExportError(
            f"export target {str(out)!r} holds files but no export (no config.json or adapter_config.json); --overwrite replaces "
            "only a previous export: give a new or empty directory"
        )


def _set_bounds(processor_cfg: dict, min_pixels: int, max_pixels: int) -> None:
    # `size` is what transformers 5.x reads, min_/max_pixels what 4.57 reads (it overrides `size`
    # with its class defaults when they are absent); both versions take both spellings
    processor_cfg["size"] = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    processor_cfg["min_pixels"], processor_cfg["max_pixels"] = min_pixels, max_pixels


def write_run_processing(out: Path, data, family) -> None:
    """The run's ``data`` resize bounds and video sampling into ``out``'s processor files.

    The base model's ``preprocessor_config.json`` has the base's bounds (``longest_edge`` 12544
    for the tiny model); training resized into ``[data.min_pixels, data.max_pixels]``: a
    300x168 image is 10 image tokens under the first and 66 under the defaults of the second.
    Videos: ``family``'s video rule (:data:`qwenkit.data.video.RULES`) spells its sampling and
    bounds in the keys of the transformers video processor that follows it (``hf_settings``:
    per-frame bounds for Qwen2-VL's, a volume bound for Qwen3-VL's); a base without a
    ``video_preprocessor_config.json`` (the embedded tiny models) gets one, with the image
    processor's patching and normalisation, since the vision tower reads both the same way.
    """
    rule = video.RULES[family.video_rule]
    image_path, video_path = out / "preprocessor_config.json", out / "video_preprocessor_config.json"
    patching = json.loads(image_path.read_text()) if image_path.is_file() else {}
    patching = {k: v for k, v in patching.items() if k in VIDEO_SHARED_KEYS}
    if patching and not video_path.is_file():
        video_path.write_text(json.dumps({"video_processor_type": rule.hf_class, **patching}) + "\n")

    def image(d: dict) -> None:
        _set_bounds(d, data.min_pixels, data.max_pixels)

    def video_settings(d: dict) -> None:
        known = {**patching, **d}
        d.update(rule.hf_settings(data, known["patch_size"] * known["merge_size"]))

    for path, update in ((image_path, image), (video_path, video_settings)):
        if path.is_file():
            d = json.loads(path.read_text())
            update(d)
            path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    path = out / "processor_config.json"  # a processor saved whole nests its parts here
    if path.is_file():
        d = json.loads(path.read_text())
        for key, update in (("image_processor", image), ("video_processor", video_settings)):
            if isinstance(d.get(key), dict):
                update(d[key])
        path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def load_hf(checkpoint: str | Path, cfg, spec: ModelSpec):
    """A checkpoint's model as a plain HF model of its family (e.g. ``Qwen3VLForConditionalGeneration``) on the CPU;
    ``spec``: the run's model (:func:`qwenkit.model.families.spec.of_run` of ``cfg.model``).

    A LoRA run's is its :func:`load_peft` model with the adapters merged (peft's ``merge_and_unload``); a
    ``model.mtp.train`` one's then carries its MTP layer, merged too, as ``mtp`` (``qwenkit eval`` measures
    its acceptance there; the export takes it off, :func:`take_mtp`).

    Runs in one process without a process group: DCP gathers every shard into full tensors of
    the HF model built with parameters on meta, then given CPU storage. Non-persistent buffers
    (rotary ``inv_freq``) are in no checkpoint: they keep the values computed at construction.
    """
    if cfg.lora.r > 0:
        return load_peft(checkpoint, cfg, spec).merge_and_unload()
    ckpt = resolve(checkpoint)
    hf = build_on_meta(spec.family.load("hf_class"), spec.hf_config())
    buffers = {name: buf.clone() for name, buf in hf.named_buffers()}
    hf.to_empty(device="cpu")
    hf.to(DTYPES[cfg.model.dtype])
    for name, buf in buffers.items():
        set_buffer(hf, name, buf)
    state = hf.state_dict()
    saved = set(dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    wanted = {k: v for k, v in state.items() if f"model.{k}" in saved}
    tied = {n for group in tied_groups(hf) if any(n in wanted for n in group) for n in group}  # one name saved
    missing = sorted(set(state) - set(wanted) - tied)
    if missing:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks model tensors: {', '.join(missing[:5])}")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load({"model": wanted}, checkpoint_id=str(ckpt), no_dist=True)
    return hf
