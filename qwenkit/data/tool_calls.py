"""How a family's chat template writes tools, tool calls and tool responses: the text agentic rollouts render and
parse, and the tool SFT rows' template writes (:mod:`qwenkit.data.template`; in the data floor so both reach it).

Two formats, the family entry's ``tool_calls`` (:class:`qwenkit.model.families.entry.Family`), each the text the
checkpoints' own template writes (the reference: the official templates TRL ships, ``trl/chat_templates/qwen3_vl.jinja``
and ``qwen3_5_nothink.jinja``, rendered with ``tools=`` and ``role: tool`` messages in ``tests/engine/rollouts/test_agentic.py``):

- ``hermes`` (Qwen3-VL; Qwen2.5-VL, whose template has no tool branch, is written as Qwen3-VL's and Qwen2.5's
  are): the system turn is the system text, ``\\n\\n``, then ``# Tools ... <tools>`` with one JSON schema a line;
  a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``xml`` (Qwen3.5): the tools block first, then ``\\n\\n`` and the system text; a call is
  ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``.

A reply's calls follow its text (:func:`calls_text`): hermes puts ``\\n`` before each call but a first one after no
text, writes string arguments as they are and others as JSON; xml puts ``\\n\\n`` before a first call after text
(``\\n`` before later ones) and writes each argument as JSON when it is a mapping or a list, else as its string.

In both, the tool responses after a reply are one ``user`` turn, ``<|im_start|>user`` then
``\\n<tool_response>\\n{content}\\n</tool_response>`` per response, ``<|im_end|>\\n`` (Qwen3.5 trims the content),
and the next reply opens as the prompt's does (``<|im_start|>assistant\\n``). An image in a response is the
family's vision span, as in a user turn.
"""

from __future__ import annotations

import json
import re

FORMATS = ("hermes", "xml")

_HERMES_TOOLS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
                 "function signatures within <tools></tools> XML tags:\n<tools>")  # fmt: skip
_HERMES_END = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")  # fmt: skip
_XML_TOOLS = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
_XML_END = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural "
    "language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question "
    "like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>\n?(.*?)</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def system_text(style: str, system: str | None, schemas: list[dict]) -> str:
    """The system turn's text with ``schemas`` (``transformers.utils.get_json_schema``'s) and the conversation's
    ``system`` text (None or empty: none), as the family's template writes it between ``<|im_start|>system\\n``
    and ``<|im_end|>``; HF's ``tojson`` is ``json.dumps(..., ensure_ascii=False)``."""
    listed = "".join("\n" + json.dumps(s, ensure_ascii=False) for s in schemas)
    if style == "xml":
        return _XML_TOOLS + listed + _XML_END + (f"\n\n{system.strip()}" if system and system.strip() else "")
    return (f"{system}\n\n" if system else "") + _HERMES_TOOLS + listed + _HERMES_END


def calls_text(style: str, content: str, calls: list[dict]) -> str:
    """The text of ``calls`` (``{"name", "arguments"}``; arguments a mapping, or a JSON string) after a reply's
    ``content``, as the family's template writes ``tool_calls`` (module docstring); HF's ``tojson`` is
    ``json.dumps(..., ensure_ascii=False)`` and Jinja's ``string`` Python's ``str``."""
    out = ""
    for k, call in enumerate(calls):
        name, arguments = call["name"], call.get("arguments", {})
        if style == "xml":
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
            out += ("\n" if k else "\n\n" if content.strip() else "") + f"<tool_call>\n<function={name}>\n"
            for key, value in arguments.items():
                value = json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else str(value)
                out += f"<parameter={key}>\n{value}\n</parameter>\n"
            out += "</function>\n</tool_call>"
            continue
        written = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        out += ("\n" if k or content else "") + f'<tool_call>\n{{"name": "{name}", "arguments": {written}}}\n</tool_call>'
    return out


def parse_calls(style: str, text: str) -> list[dict] | None:
    """The ``{"name", "arguments"}`` calls of a reply's ``text``, in order: ``[]`` when it makes none, None when a
    ``<tool_call>`` block does not parse (the reply is then the model's text, a failed call)."""
    if "<tool_call>" not in text:
        return []
    blocks = _CALL.findall(text)
    if len(blocks) != text.count("<tool_call>"):  # an unclosed block
        return None
    calls = []
    for block in blocks:
        call = _parse_xml(block) if style == "xml" else _parse_hermes(block)
        if call is None:
            return None
        calls.append(call)
    return calls


def _parse_hermes(block: str) -> dict | None:
    try:
        call = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return {"name": call["name"], "arguments": arguments} if isinstance(arguments, dict) else None


def _parse_xml(block: str) -> dict | None:
    match = _FUNCTION.match(block.strip("\n"))
    if match is None:
        return None
    arguments = {}
    for name, value in _PARAMETER.findall(match[2]):
        try:  # the template writes mappings and lists as JSON, everything else as its string
            arguments[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            arguments[name.strip()] = value
    return {"name": match[1].strip(), "arguments": arguments}


def response_body(style: str, contents: list[str]) -> str:
    """The ``<tool_response>`` blocks of a reply's responses, between ``<|im_start|>user`` and ``<|im_end|>``."""
    return "".join(f"\n<tool_response>\n{c.strip() if style == 'xml' else c}\n</tool_response>" for c in contents)


def response_text(style: str, contents: list[str]) -> str:
    """The user turn holding a reply's tool responses (``contents``: each response's text, its images already
    written as vision spans), from ``<|im_start|>user`` to its ``<|im_end|>\\n``."""
    return f"<|im_start|>user{response_body(style, contents)}<|im_end|>\n"


__all__ = ["FORMATS", "calls_text", "parse_calls", "response_body", "response_text", "system_text"]
