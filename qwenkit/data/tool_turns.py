"""Tool rows (multi-turn tool SFT): the tool definitions, calls and responses of the layouts people bring, read
into the turns every layout reads (:class:`qwenkit.data.layout_readers.Read`).

A reply's calls stay structured (``{"name", "arguments"}``, keyed by the reply's turn) until the family's template
writes them (:func:`qwenkit.data.tool_calls.calls_text`); a response is a turn of role ``tool`` (its ``<image>``
placeholders are images, as in a user turn); the row's tools are JSON schemas, ``{"type": "function",
"function": {...}}`` (a bare ``{"name", "description", "parameters"}`` is wrapped so, as LLaMA-Factory's Qwen tool
format and ``transformers.utils.get_json_schema`` write it).

=======================  ==============================================================================
rows as written by       a call; a response; the tools
=======================  ==============================================================================
HF / TRL / OpenAI        an assistant message's ``tool_calls: [{"type": "function", "function": {"name",
(``messages``, typed)    "arguments"}}]`` (arguments a mapping or a JSON string); ``role: tool``; ``tools``
LLaMA-Factory sharegpt   ``from: function_call`` in a reply's place, its value JSON ``{"name", "arguments"}`` or a
                         list of them (parallel calls); ``from: observation``; ``tools`` (a JSON string)
ms-swift (``messages``)  ``role: tool_call``, its content JSON ``{"name", "arguments"}``; consecutive ones (or one
                         after an assistant message) are one reply's calls; ``role: tool_response``; ``tools``
=======================  ==============================================================================

``tools`` may be a list or a JSON string of one. Bad rows name the message and what is wrong: a call without a
name, arguments that are not a JSON object, a call of a tool the row's ``tools`` does not define, a response
with no call before it (:func:`check_order`).
"""

from __future__ import annotations

import json
from typing import Any

from qwenkit.data.report import BadSample, Location

CALL_ROLES = ("function_call", "tool_call")  # a message holding a reply's calls (LLaMA-Factory, ms-swift)
RESPONSE_ROLES = ("tool", "observation", "tool_response")  # a tool's response (HF, LLaMA-Factory, ms-swift)


def _bad(where: Location, detail: str) -> BadSample:
    return BadSample(where, "bad_tool", detail)


def _json(value: Any, what: str, where: Location) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise _bad(where, f"{what} is a string but not JSON ({e.msg} at column {e.colno})") from None


def schemas(row: dict, where: Location) -> list[dict]:
    """The row's ``tools`` as a list of ``{"type": "function", "function": {...}}`` schemas ([] without any)."""
    raw = _json(row.get("tools"), "'tools'", where)
    if raw in (None, "", []):
        return []
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise _bad(where, f"'tools' must be a list of function schemas (or a JSON string of one), got {type(raw).__name__}")
    out = []
    for k, tool in enumerate(raw):
        tool = _json(tool, f"'tools' entry {k}", where)
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else tool
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise _bad(where, f"'tools' entry {k} has no function name (a JSON schema {{\"name\", \"description\", \"parameters\"}})")
        out.append(tool if function is not tool else {"type": "function", "function": tool})
    return out


def names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def call(raw: Any, what: str, where: Location) -> dict:
    """One call as ``{"name", "arguments"}``: HF's ``{"type": "function", "function": {...}}`` or a bare
    ``{"name", "arguments"}``; arguments a mapping or a JSON string of one (kept as written: hermes writes it so)."""
    raw = _json(raw, what, where)
    if isinstance(raw, dict) and isinstance(raw.get("function"), dict):
        raw = raw["function"]
    if not isinstance(raw, dict):
        raise _bad(where, f"{what} must be an object {{\"name\", \"arguments\"}}, got {type(raw).__name__}")
    name = raw.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _bad(where, f"{what} has no 'name' (the tool it calls)")
    arguments = raw.get("arguments", raw.get("parameters", {}))
    parsed = _json(arguments, f"{what} 'arguments'", where)
    if not isinstance(parsed, dict):
        raise _bad(where, f"{what} 'arguments' must be a JSON object, got {type(parsed).__name__}")
    return {"name": name, "arguments": arguments if isinstance(arguments, str) else parsed}


def calls_of_message(content: Any, i: int, role: str, where: Location) -> list[dict]:
    """The calls a ``function_call`` / ``tool_call`` message holds: one JSON call, or a list of them."""
    raw = _json(content, f"message {i} ({role})", where)
    listed = raw if isinstance(raw, list) else [raw]
    if not listed:
        raise _bad(where, f"message {i} ({role}) holds no call")
    return [call(c, f"message {i} ({role}) call {k}" if len(listed) > 1 else f"message {i} ({role})", where)
            for k, c in enumerate(listed)]  # fmt: skip


def add_message(turns: list[tuple[str, str]], calls: dict[int, list[dict]], numbers: list[int], i: int, role: str,
                text: str, message: dict, where: Location) -> None:  # fmt: skip
    """Append message ``i`` (``role`` already read: user/assistant/system/tool, or a call role) to ``turns`` and its
    number to ``numbers``; an assistant's ``tool_calls`` and a call message's calls go to ``calls`` under their
    reply's turn (a call message after an assistant message joins it: no turn of its own)."""
    if role in CALL_ROLES:
        made = calls_of_message(message.get("content", message.get("value")), i, role, where)
        if not turns or turns[-1][0] != "assistant":
            turns.append(("assistant", ""))
            numbers.append(i)
        calls.setdefault(len(turns) - 1, []).extend(made)
        return
    turns.append((role, text))
    numbers.append(i)
    listed = message.get("tool_calls")
    if role == "assistant" and listed:
        if not isinstance(listed, list):
            raise _bad(where, f"message {i} 'tool_calls' must be a list, got {type(listed).__name__}")
        calls[len(turns) - 1] = [call(c, f"message {i} tool call {k}", where) for k, c in enumerate(listed)]
    elif listed:
        raise _bad(where, f"message {i} ({role}) has 'tool_calls'; only an assistant message calls tools")


def check_order(turns: list[tuple[str, str]], calls: dict[int, list[dict]], tools: list[dict], numbers: list[int],
                where: Location) -> None:  # fmt: skip
    """Responses follow a reply that calls (or another response) and are followed by a reply; a call names a tool
    the row defines (when it defines any). ``numbers``: each turn's message number in the row."""
    defined = names(tools)
    for k, (role, _) in enumerate(turns):
        if role == "tool":
            before = turns[k - 1][0] if k else None
            if before != "tool" and not (before == "assistant" and k - 1 in calls):
                raise _bad(where, f"message {numbers[k]} is a tool response with no tool call before it")
            if k + 1 < len(turns) and turns[k + 1][0] not in ("tool", "assistant"):
                raise BadSample(where, "turn_order", f"message {numbers[k + 1]} is from {turns[k + 1][0]}, expected "
                                "assistant after the tool responses")  # fmt: skip
        for c in calls.get(k, ()):
            if defined and c["name"] not in defined:
                raise _bad(where, f"message {numbers[k]} calls {c['name']!r}, which the row's 'tools' does not define "
                           f"(it defines {', '.join(defined)})")  # fmt: skip
