"""Reading a configuration: YAML 1.2, dotted overrides, values typed against the dataclasses'
hints, then :func:`qwenkit.config.validate.validate`; and writing the resolved one.

All problems found are reported together in one :class:`ConfigError`, each naming the key path,
the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from qwenkit.config.schema import Config
from qwenkit.config.validate import validate

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """One or more configuration problems; the message lists each with its key path."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        if len(problems) == 1:  # one line, as every subcommand reports a user error
            super().__init__(f"invalid configuration: {problems[0]}")
        else:
            super().__init__("invalid configuration:\n  - " + "\n  - ".join(problems))


# ---------------------------------------------------------------------------------------------
# YAML 1.2


class Loader(yaml.SafeLoader):
    """PyYAML's safe loader with the values people type read as they mean them (YAML 1.2's core schema).

    PyYAML implements YAML 1.1: ``1e-4`` (no dot) is a string there, and ``off``/``no``/``on``/
    ``yes`` are booleans, so ``train.lr: 1e-4`` and ``model.fused_ops: off`` were refused. Here
    every exponent spelling is a float, only ``true``/``false`` are booleans (a bool field still
    takes yes/no/on/off, see :func:`_coerce`), and a key given twice in one mapping is warned about.
    """

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str) and key in seen:
                log.warning(
                    "%s: key %r given twice (lines %d and %d); the last one is used",
                    self.name, key, seen[key] + 1, key_node.start_mark.line + 1,
                )  # fmt: skip
            seen.setdefault(key, key_node.start_mark.line)
        return super().construct_mapping(node, deep=deep)


# Drop YAML 1.1's bool and float resolvers, then add YAML 1.2's (floats also with underscores,
# as Python's float() and YAML 1.1 take them).
Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9][0-9_]*)?
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9][0-9_]*)?
        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9][0-9_]*
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
# YAML 1.1's bool words, which a bool field still takes (PyYAML read them as booleans before)
BOOL_WORDS = {"yes": True, "on": True, "no": False, "off": False}


def parse_yaml(text: str, name: str = "<override>") -> Any:
    """``text`` read with :class:`Loader`; ``name`` (a file) is what a duplicate-key warning names."""
    loader = Loader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


# ---------------------------------------------------------------------------------------------
# Files and overrides into a Config


def load(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None,
         rewards: bool = True) -> Config:  # fmt: skip
    """Read a YAML file (or start from defaults), apply overrides, validate, return a Config.
    ``rewards=False``: ``grpo.rewards``' functions are not imported (a command that never calls them)."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError([f"config file {str(path)!r} does not exist"])
        try:
            raw = parse_yaml(path.read_text(), str(path))
        except yaml.YAMLError as e:
            raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
        if raw is None:
            log.warning("%s is empty: the run uses the built-in defaults (see qwenkit/config/)", path)
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError([f"{path}: top level must be a mapping, got {type(raw).__name__}"])
    problems: list[str] = []
    for key, value in _parse_overrides(overrides, problems):
        _set_dotted(raw, key, value, problems)
    unset: list[str] = []  # keys that did not type: the config holds their defaults
    cfg = _build(Config, raw, "", problems, unset)
    # every rule runs on the rest, so a bad type does not hide the range errors beside it; a rule
    # that names an unset key would judge the default it fell back to, not what was written
    problems.extend(p for p in validate(cfg, rewards) if not any(_names(p, key) for key in unset))
    if problems:
        raise ConfigError(problems)
    return cfg


def write_config(cfg: Config, output_dir: str | Path, name: str = "config.yaml") -> Path:
    """``<output_dir>/config.yaml``: the resolved config, the run's record ``qwenkit export`` finds
    (``name``: another file, such as the copy the launcher writes for the ranks).

    Written to a temporary name and renamed, so a reader never sees half a file.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / name
    tmp = path.with_name(f".{name}.{os.getpid()}")
    tmp.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    os.replace(tmp, path)
    return path


def _parse_overrides(overrides, problems: list[str]):
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return list(overrides.items())
    pairs, seen = [], {}
    for item in overrides:
        if "=" not in item:
            problems.append(f"override {item!r} must look like key.path=value")
            continue
        key, text = item.split("=", 1)
        key = key.strip()
        try:
            value = parse_yaml(text) if text.strip() else ""
        except yaml.YAMLError as e:
            problems.append(f"override {item!r}: not valid YAML: {str(e).splitlines()[0]}")
            continue
        if key in seen:
            log.warning("override %s given twice (%r, then %r); the last one is used", key, seen[key], text)
        seen[key] = text
        pairs.append((key, value))
    return pairs


def _set_dotted(raw: dict, key: str, value: Any, problems: list[str]) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            problems.append(f"override {key!r}: {'.'.join(parts[: i + 1])} is not a section")
            return
        node = nxt
    node[parts[-1]] = value


def _names(problem: str, key: str) -> bool:
    """Whether ``problem`` names the dotted ``key`` (or a key under it)."""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", problem) is not None


def _build(cls, raw: Any, prefix: str, problems: list[str], unset: list[str]):
    """``cls`` from the mapping ``raw``; what cannot be used is a problem, its key in ``unset``."""
    where = prefix.rstrip(".") or "<top level>"
    if not isinstance(raw, dict):
        problems.append(f"{where} must be a mapping, got {raw!r}")
        unset.append(where)
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    spelled = {f.metadata["key"]: f.name for f in dataclasses.fields(cls) if "key" in f.metadata}  # checkpoint.async
    typed = {}  # field name -> the key as the user typed it (its messages name that key)
    for key in raw:
        name = spelled.get(key, key)
        if name in typed:
            problems.append(f"{prefix}{typed[name]} and {prefix}{key} are one setting, given twice: keep "
                            f"{prefix}{next(k for k, n in spelled.items() if n == name)}")  # fmt: skip
        typed[name] = key
    raw = {spelled.get(k, k): v for k, v in raw.items()}
    for key in raw:
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix + near[0]!r}?" if near else f"; allowed: {', '.join(names)}"
            problems.append(f"unknown key {prefix + str(key)!r}{hint}")
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, raw[name], f"{prefix}{name}.", problems, unset)
            continue
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if dataclasses.is_dataclass(item):  # a list of sections, e.g. train.param_groups
            if isinstance(raw[name], list):
                kwargs[name] = [_build(item, r, f"{prefix}{name}[{i}].", problems, unset) for i, r in enumerate(raw[name])]
            else:
                problems.append(f"{prefix}{name}: got {raw[name]!r}, expected a list of mappings")
                unset.extend({f"{prefix}{name}", f"{prefix}{typed[name]}"})
            continue
        ok, value = _coerce(raw[name], hint)
        if ok:
            kwargs[name] = value
        else:
            problems.append(f"{prefix}{typed[name]}: got {raw[name]!r}, expected {_describe(hint)}{_bool_hint(raw[name], hint)}")
            unset.extend({f"{prefix}{name}", f"{prefix}{typed[name]}"})
    return cls(**kwargs)


def _coerce(value: Any, hint) -> tuple[bool, Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return True, value
    if origin in (Union, types.UnionType):
        for arg in args:
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, None
    if origin is Literal:
        return (value in args and type(value) is type(next(a for a in args if a == value))), value
    if hint is type(None):
        return value is None, None
    if origin is list:
        if not isinstance(value, list):
            return False, None
        out = []
        for item in value:
            ok, v = _coerce(item, args[0])
            if not ok:
                return False, None
            out.append(v)
        return True, out
    if hint is bool:
        if isinstance(value, str) and value.lower() in BOOL_WORDS:
            return True, BOOL_WORDS[value.lower()]
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):  # every spelling Python's float() takes ("1e-4", "infinity", " 2E5 ")
            try:
                return True, float(value)
            except ValueError:
                return False, None
        return False, None
    if hint is str:
        return isinstance(value, str), value
    return isinstance(value, hint), value


def _wants_str(hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_wants_str(a) for a in args)
    return hint is str or (origin is Literal and any(isinstance(a, str) for a in args))


def _bool_hint(value: Any, hint) -> str:
    """The reason a bare ``false`` was refused where a string is meant: YAML made it a boolean."""
    if isinstance(value, bool) and _wants_str(hint):
        return f" (YAML reads a bare {str(value).lower()} as a boolean; quote it, e.g. '{str(value).lower()}', to mean the string)"
    return ""


def _describe(hint) -> str:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if hint is type(None):
        return "null"
    if origin is list:
        return f"a list of {_describe(args[0])}"
    return getattr(hint, "__name__", str(hint))
