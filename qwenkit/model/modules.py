"""Module paths as users write them in the config: one matching rule for every key that names modules.

``parallel.shard_patterns``, ``parallel.recompute``, ``lora.target_modules``,
``lora.modules_to_save`` and ``train.param_groups`` all name modules by dotted path, with ``*``
standing for one segment (``model.language_model.layers.*``). A recompute wrapper adds a
``._checkpoint_wrapped_module`` segment that the user never writes: :func:`module_path` removes it.
"""

from __future__ import annotations

import fnmatch

WRAPPED = "._checkpoint_wrapped_module"


def module_path(name: str) -> str:
    """A module (or parameter) path as the user writes it: without checkpoint_wrapper's inner segment."""
    return name.replace(WRAPPED, "")


def prefix_match(name: str, pattern: str) -> int:
    """Segments of ``name`` that ``pattern`` matches as a path prefix (``*`` = one segment); 0: none."""
    parts, pats = name.split("."), pattern.split(".")
    if len(parts) < len(pats):
        return 0
    return len(pats) if all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pats)) else 0


def path_match(name: str, pattern: str) -> bool:
    """``pattern`` matches the whole of ``name``, segment by segment (``*`` = one segment)."""
    return prefix_match(name, pattern) == len(name.split("."))
