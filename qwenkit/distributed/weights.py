"""Load a Hugging Face checkpoint's safetensors straight into FSDP2 shards (meta-device init).

With ``model.init_device: meta`` the model is built without storage, sharded, given storage for
its shards only (:func:`qwenkit.distributed.fsdp.materialize`), and then filled here: each rank reads just
the rows of each tensor that its shards hold (``safe_open(...).get_slice``), so no rank ever
holds the whole model. torch 2.8+ does this through DCP's ``HuggingFaceStorageReader``; older
torch (2.7, what torch_npu 2.7.1 pairs with) lacks it, and :func:`read_slices` reads the same
rows with safetensors directly, each shard's place in the full tensor taken from the DTensor's
chunk list, as DCP's planner does.

Qwen2.5-VL checkpoints name tensors in one of two layouts: the hub's (``model.layers.*``,
``visual.*``, ``audio_tower.*`` of an Omni thinker, which transformers 5.x also writes) and transformers
4.52+'s in-memory one (``model.language_model.layers.*``, ``model.visual.*``). :func:`model_key` maps
both to the model's state-dict keys. A whole Omni checkpoint holds the thinker's under ``thinker.``
beside the talker's and the vocoder's: only the thinker's are read. Qwen3-Omni's checkpoints hold each
expert's linears apart (``mlp.experts.N.gate_proj.weight``): :func:`read_experts` fuses them into the
model's 3-D expert weights, each rank reading only its experts. Qwen4-Exp's checkpoints split each n-gram
table in parts along dim 0 (``ngram_embedding.shard_<i>.weight``): each rank reads its columns of every part
(:func:`qwenkit.distributed.columns.read_parts`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

try:
    from torch.distributed.checkpoint import HuggingFaceStorageReader
except ImportError:  # torch < 2.8
    HuggingFaceStorageReader = None

from qwenkit.distributed import columns
from qwenkit.distributed.meta import tied_groups
from qwenkit.model.families import registry as families
from qwenkit.model.lora import base_key, is_adapter_key
from qwenkit.model.modules import module_path


def model_key(file_key: str, prefix: str = "") -> str | None:
    """A checkpoint tensor name in the model's state-dict layout; None for a tensor of another part
    of the whole checkpoint (``prefix``: the trained part's, e.g. ``thinker.``)."""
    if prefix:
        if not file_key.startswith(prefix):
            return None
        file_key = file_key[len(prefix) :]
    if file_key.startswith(("visual.", "audio_tower.")):
        return "model." + file_key
    if file_key.startswith("model.") and not file_key.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + file_key[len("model.") :]
    return file_key


def load_hf_weights(model: nn.Module, path: str | Path) -> int:
    """Fill a (sharded, materialised) model from the ``*.safetensors`` files in ``path``.

    Every model tensor must be found, except a tied weight whose partner is in the files
    (tied checkpoints store ``embed_tokens`` only). Returns the number of tensors read.
    """
    files = tensor_files(path)
    if not files:
        raise FileNotFoundError(f"model.path={str(path)!r}: no *.safetensors weights found")
    whole = families.of_model(model).whole  # a whole Omni checkpoint: the thinker's tensors only
    prefix = whole.prefix if whole is not None and any(k.startswith(whole.prefix) for k in files) else ""
    by_model_key = {key: k for k in files if (key := model_key(k, prefix)) is not None}
    state = get_model_state_dict(model)  # sharded DTensors, keys without wrapper segments
    # LoRA: a base weight sits under .base_layer; adapters are in no base checkpoint (see load_adapters)
    file_key = {k: by_model_key[base_key(k)] for k in state if base_key(k) in by_model_key}
    to_load = {file_key[k]: state[k] for k in file_key}
    fused = {k: sources for k in state if k not in file_key and (sources := expert_sources(base_key(k), by_model_key))}
    split = {k: parts for k in state if k not in file_key and (parts := columns.part_sources(base_key(k), by_model_key))}
    partners = {module_path(n): [module_path(o) for o in g if o != n] for g in tied_groups(model) for n in g}
    missing = [
        k for k in state
        if k not in file_key and k not in fused and k not in split and not is_adapter_key(k)
        and not any(p in by_model_key for p in partners.get(k, ()))
    ]  # fmt: skip
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise KeyError(f"model.path={str(path)!r}: the checkpoint lacks {shown}")
    if HuggingFaceStorageReader is not None:
        dcp.load(to_load, storage_reader=HuggingFaceStorageReader(str(path)))  # in place, own rows only
    else:
        read_slices(to_load, files)
    for key, sources in fused.items():
        read_experts(state[key], sources, files)
    for key, parts in split.items():
        columns.read_parts(state[key], parts, files)
    loaded = {k: to_load[f] for k, f in file_key.items()} | {k: state[k] for k in (*fused, *split)}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    return len(to_load) + sum(len(row) for sources in fused.values() for row in sources) + sum(map(len, split.values()))


# a fused expert weight of the model ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) and the linears of one expert
# that a checkpoint storing experts apart (Qwen3-Omni's) holds for its row, concatenated along their first dimension
# (transformers' own conversion: qwen2_moe in its conversion_mapping.py)
EXPERT_LINEARS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def expert_sources(key: str, by_model_key: dict[str, str]) -> list[list[str]] | None:
    """The file keys of each expert's linears that make the fused expert weight ``key``, one list per
    expert in order; None when ``key`` is no fused expert weight or the checkpoint does not hold it apart."""
    module, _, name = key.rpartition(".")
    if not module.endswith(".experts") or name not in EXPERT_LINEARS:
        return None
    rows = []
    while all(f"{module}.{len(rows)}.{linear}.weight" in by_model_key for linear in EXPERT_LINEARS[name]):
        rows.append([by_model_key[f"{module}.{len(rows)}.{linear}.weight"] for linear in EXPERT_LINEARS[name]])
    return rows or None


@torch.no_grad()  # a parameter, filled in place
def read_experts(target: torch.Tensor, sources: list[list[str]], files: dict[str, Path]) -> None:
    """Fill a fused expert weight (a sharded DTensor or a plain tensor) from each expert's linears: only
    the experts of this rank's rows are read (FSDP2 and expert parallelism split the expert dimension)."""
    local, index = target, tuple(slice(0, n) for n in target.shape)
    if isinstance(target, DTensor):
        local = target.to_local()
        if local.numel() == 0:  # a rank past the last expert of an unevenly sharded weight
            return
        (chunk,) = target.__create_chunk_list__()
        index = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
    if len(sources) != target.shape[0]:
        raise ValueError(f"the checkpoint holds {len(sources)} experts for a weight of {target.shape[0]}")
    for row, e in enumerate(range(index[0].start, index[0].stop)):
        parts = []
        for file_key in sources[e]:
            with safe_open(str(files[file_key]), framework="pt") as f:
                parts.append(f.get_tensor(file_key))
        local[row].copy_(torch.cat(parts)[index[1:]])


def load_adapters(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Write full adapter tensors (the same on every rank) into their shards."""
    set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True, strict=False))


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the ``*.safetensors`` file holding it (headers only are read)."""
    files = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), file))
    return files


@torch.no_grad()  # the targets are parameters: filled in place, no autograd history
def read_slices(targets: dict[str, torch.Tensor], files: dict[str, Path]) -> None:
    """Copy into each target (a sharded DTensor or a plain tensor) its rows of the file tensor."""
    by_file: dict[Path, list[str]] = {}
    for key in targets:
        by_file.setdefault(files[key], []).append(key)
    for file, keys in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for key in keys:
                target = targets[key]
                source = f.get_slice(key)
                if list(source.get_shape()) != list(target.shape):
                    raise ValueError(
                        f"{file}: tensor {key!r} has shape {source.get_shape()}, the model's is {list(target.shape)}"
                    )
                if not isinstance(target, DTensor):
                    target.copy_(f.get_tensor(key))
                    continue
                local = target.to_local()
                if local.numel() == 0:  # a rank past the last row of an unevenly sharded tensor
                    continue
                # one chunk per rank for FSDP2 (Shard(0), HSDP's Replicate): where its rows lie
                (chunk,) = target.__create_chunk_list__()
                index = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
                local.copy_(source[index])

