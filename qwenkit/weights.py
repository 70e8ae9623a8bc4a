"""Load a Hugging Face checkpoint's safetensors straight into FSDP2 shards (meta-device init).

With ``model.init_device: meta`` the model is built without storage, sharded, given storage for
its shards only (:func:`qwenkit.fsdp.materialize`), and then filled here through DCP's
``HuggingFaceStorageReader``: each rank reads just the rows of each tensor that its shards hold
(``safe_open(...).get_slice``), so no rank ever holds the whole model.

Qwen2.5-VL checkpoints name tensors in one of two layouts: the hub's (``model.layers.*``,
``visual.*``, which transformers 5.x also writes) and transformers 4.52+'s in-memory one
(``model.language_model.layers.*``, ``model.visual.*``). :func:`model_key` maps both to the
model's state-dict keys.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from qwenkit.fsdp import module_path


def model_key(file_key: str) -> str:
    """A checkpoint tensor name in the model's state-dict layout."""
    if file_key.startswith("visual."):
        return "model." + file_key
    if file_key.startswith("model.") and not file_key.startswith(("model.language_model.", "model.visual.")):
        return "model.language_model." + file_key[len("model.") :]
    return file_key


def load_hf_weights(model: nn.Module, path: str | Path) -> int:
    """Fill a (sharded, materialised) model from the ``*.safetensors`` files in ``path``.

    Every model tensor must be found, except a tied weight whose partner is in the files
    (tied checkpoints store ``embed_tokens`` only). Returns the number of tensors read.
    """
    reader = HuggingFaceStorageReader(str(path))
    file_keys = list(reader.read_metadata().state_dict_metadata)
    if not file_keys:
        raise FileNotFoundError(f"model.path={str(path)!r}: no *.safetensors weights found")
    by_model_key = {model_key(k): k for k in file_keys}
    state = get_model_state_dict(model)  # sharded DTensors, keys without wrapper segments
    to_load = {by_model_key[k]: t for k, t in state.items() if k in by_model_key}
    missing = [k for k in state if k not in by_model_key and not _tied_partner_loaded(model, k, by_model_key)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise KeyError(f"model.path={str(path)!r}: the checkpoint lacks {shown}")
    dcp.load(to_load, storage_reader=reader)  # in place, each rank only its own shard rows
    loaded = {model_key(k): t for k, t in to_load.items()}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))
    return len(to_load)


def _tied_partner_loaded(model: nn.Module, key: str, available: dict[str, str]) -> bool:
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(module_path(name))
    for names in groups.values():
        if key in names:
            return any(n in available for n in names if n != key)
    return False
