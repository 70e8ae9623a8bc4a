"""A run's model resolved once: the family entry and the checkpoint's ``config.json``, passed down.

torchtitan builds a model's ``ModelSpec`` once and hands it to every component. qwenkit resolves
``model.name`` against the checkpoint once per process (:func:`resolve`, :func:`of_run`,
:func:`of_export`) and passes the :class:`ModelSpec` (or its entry) down: the export, ``qwenkit eval``,
the resume rule's record of the model, the processor (:class:`qwenkit.model.processor.Processor`
carries the entry). No module outside ``qwenkit/model/`` reads a checkpoint's ``config.json`` to find
its family (``tests/test_architecture.py``); a built model's family is its own config's
(:func:`qwenkit.model.families.registry.of_model`), read from memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig

from qwenkit.model.families import registry as families
from qwenkit.model.families.entry import Family
from qwenkit.model.paths import resolve_path


@dataclass(frozen=True)
class ModelSpec:
    """The family a checkpoint directory holds, resolved against ``model.name``."""

    family: Family  # the entry (qwenkit.model.families.registry.FAMILIES)
    path: Path  # the checkpoint directory (model.path resolved: tiny is the cached tiny checkpoint)
    config: dict  # its config.json, as read once

    @property
    def whole(self) -> bool:
        """Whether the checkpoint is the whole model the family's is a part of (a full Omni checkpoint:
        thinker, talker, vocoder): qwenkit reads the part's weights and config from it, and the export
        writes the whole back (:attr:`qwenkit.model.families.entry.Family.whole`)."""
        whole = self.family.whole
        return whole is not None and self.config.get("model_type") == whole.model_type

    @property
    def model_config(self) -> dict:
        """The config of the model qwenkit trains: ``config.json``, or the part's section of a whole's."""
        return self.config[f"{self.family.whole.part}_config"] if self.whole else self.config

    def hf_config(self):
        """The trained model's transformers config (``AutoConfig``; of a whole checkpoint, its part's):
        the one every ``from_pretrained`` and meta build of the family's classes is given."""
        config = AutoConfig.from_pretrained(self.path, local_files_only=True)
        return getattr(config, f"{self.family.whole.part}_config") if self.whole else config


def resolve(name: str, path: str | Path) -> ModelSpec:
    """``model.name``'s entry for the checkpoint at ``path`` (:func:`qwenkit.model.families.registry.resolve`: ``auto``
    is the checkpoint's ``model_type``, another family's checkpoint is refused) with its ``config.json``."""
    path = Path(path)
    family = families.resolve(name, path)
    return ModelSpec(family, path, json.loads((path / "config.json").read_text()))


def of_run(model_cfg) -> ModelSpec:
    """The spec of a run's ``model`` section: ``model.path`` (``tiny``: the tiny checkpoint) and ``model.name``."""
    return resolve(model_cfg.name, resolve_path(model_cfg))


def of_export(target: str | Path, name: str = "auto") -> ModelSpec:
    """The spec of an export directory: its own ``config.json``, or a peft adapter directory's base model's
    (``adapter_config.json``'s ``base_model_name_or_path``: ``path`` is then the base)."""
    target = Path(target)
    adapter = target / "adapter_config.json"
    if adapter.is_file():
        return resolve(name, json.loads(adapter.read_text())["base_model_name_or_path"])
    return resolve(name, target)
