"""The tools of agentic GRPO (``grpo.tools``, ``grpo.environment``): resolved, checked before any rank starts, and called.

TRL's shape, so users' code moves over unchanged:

- ``grpo.tools: [module:function, ...]``: typed functions with Google-style docstrings; their JSON schemas are
  ``transformers.utils.get_json_schema``'s, which raises on a parameter without a type or a description;
- ``grpo.environment: module:Class``: one instance per completion (``Class()``), ``reset(**row)`` called with the
  row's columns before the rollout (a string it returns is appended to the prompt's last user turn); its public
  methods (not ``reset``, not ``_private``) are tools too, bound to that instance; the rewards receive it in
  their ``environments`` keyword, TRL's (:mod:`qwenkit.engine.objectives.rewards`).

A tool returns a string (anything else: its ``str``, a mapping or list of numbers: JSON), a PIL image, or a list of
both; an image enters the next turn as the family's vision input. A call that names no tool, whose arguments do
not bind, that raises, or that runs past ``grpo.tool_timeout_s`` becomes a response stating the error and is counted
as failed (:func:`call`), never a crash. A timed-out call's thread cannot be stopped: it is left to finish alone.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import inspect
import json
from collections.abc import Callable

from transformers.utils import get_json_schema

RESERVED = ("reset",)  # an environment's methods that are not tools


def _import(spec: str, key: str):
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{key}: {spec!r} is not module:name")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - a user's module may fail in any way: say which
        hint = "; is its folder on PYTHONPATH?" if isinstance(e, ImportError) else ""
        raise ValueError(f"{key}: {spec!r} does not import ({type(e).__name__}: {e}){hint}") from e


def environment_methods(cls: type) -> list[str]:
    """The public methods of an environment class that are its tools, in definition order."""
    return [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_") and n not in RESERVED]


class Toolbox:
    """``grpo.tools`` and ``grpo.environment`` resolved: :meth:`bind` gives one completion's tools and schemas."""

    def __init__(self, tools: list[str], environment: str | None, timeout_s: float):
        self.functions = [_import(spec, "grpo.tools") for spec in tools]
        self.environment = _import(environment, "grpo.environment") if environment else None
        self.timeout_s = timeout_s

    def bind(self, row: dict) -> tuple[dict[str, Callable], list[dict], object | None, str]:
        """``(tools by name, their schemas, the environment instance or None, reset's text or "")`` of one completion."""
        tools = {f.__name__: f for f in self.functions}
        env, text = None, ""
        if self.environment is not None:
            env = self.environment()
            said = env.reset(**row)
            text = said if isinstance(said, str) else ""
            tools |= {name: getattr(env, name) for name in environment_methods(self.environment)}
        return tools, [get_json_schema(f) for f in tools.values()], env, text


def problems(tools: list[str], environment: str | None) -> list[str]:
    """Why ``grpo.tools`` / ``grpo.environment`` cannot run, one line each (the launcher's check before spawn):
    not importable, not callable, not typed or described (``get_json_schema`` refuses it), two tools of one name,
    an environment that is not a class, has no ``reset`` or no tool."""
    out, names = [], {}
    for spec in tools:
        try:
            fn = _import(spec, "grpo.tools")
        except ValueError as e:
            out.append(str(e))
            continue
        if not callable(fn):
            out.append(f"grpo.tools: {spec!r} is a {type(fn).__name__}, not a function")
            continue
        names.setdefault(getattr(fn, "__name__", spec), []).append(spec)
        out.extend(_schema_problem(fn, f"grpo.tools: {spec!r}"))
    if environment:
        try:
            cls = _import(environment, "grpo.environment")
        except ValueError as e:
            return out + [str(e)]
        if not inspect.isclass(cls):
            return out + [f"grpo.environment: {environment!r} is a {type(cls).__name__}, not a class (one instance per completion)"]
        if not callable(getattr(cls, "reset", None)):
            out.append(f"grpo.environment: {environment!r} has no reset(**row) method (TRL's environment_factory contract)")
        methods = environment_methods(cls)
        if not methods and not tools:
            out.append(f"grpo.environment: {environment!r} has no public method: no tool to call")
        for name in methods:
            names.setdefault(name, []).append(f"{environment}.{name}")
            out.extend(_schema_problem(getattr(cls, name), f"grpo.environment: {environment}.{name}", method=True))
    for name, where in names.items():
        if len(where) > 1:
            out.append(f"grpo.tools: two tools named {name!r} ({', '.join(where)}); the model calls a tool by its name")
    return out


def _schema_problem(fn, where: str, method: bool = False) -> list[str]:
    """``get_json_schema``'s refusal of ``fn`` (an environment's method: as bound, without ``self``)."""
    try:
        if method:  # the schema of the bound method: self is not a parameter
            fn = fn.__get__(object.__new__(object), object)
        get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises its own parsing exceptions
        return [f"{where} has no JSON schema for the model ({type(e).__name__}: {e}); type every parameter and "
                "describe it in a Google-style docstring (Args:)"]  # fmt: skip
    return []


def call(tools: dict[str, Callable], name: str, arguments: dict, timeout_s: float) -> tuple[list, bool]:
    """``(content parts, failed)`` of one call: the parts are strings and PIL images in order; a failure's
    part is the error, as TRL writes it (``{"error": "..."}``)."""
    fn = tools.get(name)
    if fn is None:
        return [json.dumps({"error": f"Tool {name} not found."})], True
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        result = pool.submit(fn, **arguments).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        return [json.dumps({"error": f"Tool {name} timed out after {timeout_s:g} s (grpo.tool_timeout_s)"})], True
    except Exception as e:  # noqa: BLE001 - a tool's error is the model's to read, never the run's crash
        return [json.dumps({"error": f"{type(e).__name__}: {e}"})], True
    finally:
        pool.shutdown(wait=False)
    return parts(result), False


def parts(result) -> list:
    """A tool's return value as content parts: strings and PIL images."""
    items = result if isinstance(result, (list, tuple)) and any(_is_image(r) for r in result) else [result]
    return [r if _is_image(r) or isinstance(r, str) else _text(r) for r in items]


def _is_image(value) -> bool:
    return type(value).__module__.startswith("PIL.")


def _text(value) -> str:
    try:
        return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list, tuple)) else str(value)
    except TypeError:
        return str(value)


__all__ = ["RESERVED", "Toolbox", "call", "environment_methods", "parts", "problems"]
