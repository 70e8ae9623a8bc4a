"""One raw row → a validated :class:`Conversation` (roles, turn order, replies, placeholders).

The row's layout (``messages``, sharegpt ``conversations``, LLaVA ``image``/``conversations``,
typed content parts, ms-swift, alpaca, the_cauldron, ...) is read by :mod:`qwenkit.data.layouts`
into ``(role, text)`` turns whose ``<image>``/``<video>`` placeholders stand where the media go:
the k-th ``<image>`` is image ``k``, the k-th ``<video>`` video ``k`` and the k-th ``<audio>`` audio ``k``
(the ``audios`` column of LLaMA-Factory's and ms-swift's layouts). Everything here,
and after, is the same for every layout.

An optional ``"id"`` field is carried into error messages. Every problem raises
:class:`~qwenkit.data.report.BadSample` naming the message index (counting from 0).

**References** (what a generation is compared to: evaluation's answer metrics, GRPO's rewards):
the last assistant reply; for rows read as prompts (``prompts=True``: GRPO, whose objective reads
``prompts``), a ``solution`` or ``answer`` column where the row has one (TRL's and EasyR1's
datasets; ``solution`` first), and such a row may then end with a user turn: the whole
conversation is the prompt. The same row read for SFT or DPO is refused (``no_reply``, naming
the column): a bare answer is a reward's reference, not a reply to learn.
"""

from __future__ import annotations

import dataclasses
import unicodedata
from dataclasses import dataclass
from typing import Any

from qwenkit.data import layouts, tool_turns
from qwenkit.data.layout_readers import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, ROLES, VIDEO_PLACEHOLDER
from qwenkit.data.report import BadSample, Location
from qwenkit.model.processor import SPECIAL_TOKENS

__all__ = ["AUDIO_PLACEHOLDER", "IMAGE_PLACEHOLDER", "ROLES", "VIDEO_PLACEHOLDER", "Conversation", "parse_row"]


@dataclass
class Conversation:
    """A checked conversation: optional system text, then (role, text) turns user/assistant alternating; a reply
    that calls tools (``calls``) may be followed by ``tool`` turns, its responses, then the next reply."""

    where: Location
    system: str | None
    turns: list[tuple[str, str]]
    images: list[Any]  # raw image entries, in placeholder order; see qwenkit.data.images
    videos: list[Any] = dataclasses.field(default_factory=list)  # raw video entries; see qwenkit.data.video
    layout: str = "messages"  # the layout the row was read as (qwenkit.data.layouts)
    reference: str | None = None  # what a generation is compared to (module docstring); parse_row sets it
    audios: list[Any] = dataclasses.field(default_factory=list)  # raw audio entries; see qwenkit.data.audio
    tools: list[dict] = dataclasses.field(default_factory=list)  # tool schemas, written in the system turn
    calls: dict[int, list[dict]] = dataclasses.field(default_factory=dict)  # turn index -> that reply's tool calls


def parse_row(row: Any, where: Location, layout: str = "auto", prompts: bool = False) -> Conversation:
    """``row`` read as ``layout`` (``data.layout``; ``auto`` detects it per row) and checked.

    ``prompts``: the row is a prompt whose reference may be a column (module docstring)."""
    if not isinstance(row, dict):
        raise BadSample(where, "bad_format", f"a row must be a JSON object, got {type(row).__name__}")
    if isinstance(row.get("id"), (str, int)) and not isinstance(row.get("id"), bool):
        where = dataclasses.replace(where, id=str(row["id"]))
    read = layouts.read(row, where, layout)
    messages, system = read.messages, read.system
    if messages and messages[0][0] == "system":
        if system:
            raise BadSample(where, "bad_format", "both a 'system' field and a system message; keep one")
        system = messages[0][1]
        messages = messages[1:]
        offset = 1
    else:
        offset = 0
    numbers = (read.numbers if read.numbers is not None else list(range(len(read.messages))))[offset:]
    calls = {k - offset: made for k, made in read.calls.items()}
    if prompts and (read.tools or calls or any(role == "tool" for role, _ in messages)):
        raise BadSample(where, "bad_tool", "a prompt with tools or tool turns: GRPO's tools are grpo.tools / "
                        "grpo.environment, tool rows are SFT's")  # fmt: skip
    column = next((k for k in layouts.REFERENCE_KEYS if row.get(k) is not None), None)
    prompt_only = bool(messages) and messages[-1][0] == "user" and column is not None
    if prompt_only and not prompts:
        raise BadSample(
            where, "no_reply", f"the conversation ends with a user turn and the row's {column!r} column is its reference: "
            "a prompt for train.objective=grpo, with no reply to learn",
        )  # fmt: skip
    tool_turns.check_order(messages, calls, read.tools, numbers, where)
    _check_turns(messages, numbers, where, prompt_only, calls)
    asked = messages if prompt_only else messages[:-1]  # GRPO's prompt: every turn before the reference
    if prompts and not (read.images or read.videos) and not any(visible(t) for role, t in asked if role == "user"):
        raise BadSample(where, "empty_prompt", "the prompt has no text and no image or video: nothing to answer")
    media = ((IMAGE_PLACEHOLDER, read.images), (VIDEO_PLACEHOLDER, read.videos), (AUDIO_PLACEHOLDER, read.audios))
    for placeholder, entries in media:
        _check_placeholders(system, messages, numbers, placeholder, len(entries), where, read)
    reference = _reference(row[column], column, where) if prompts and column else messages[-1][1]
    return Conversation(where, system or None, messages, read.images, read.videos, read.layout, reference, read.audios,
                        read.tools, calls)  # fmt: skip


def _reference(value: Any, column: str, where: Location) -> str:
    """A ``solution`` / ``answer`` column as text: a string, or a number written as such."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise BadSample(where, "bad_format", f"the {column!r} column must be a string or a number, got {type(value).__name__}")
    if not visible(value):
        raise BadSample(where, "empty_reply", f"the {column!r} column (the reference) is empty")
    return value


def visible(text: str) -> str:
    """``text`` without whitespace and format characters (zero-width spaces and joiners, BOMs: Unicode Cf)."""
    return "".join(c for c in text if unicodedata.category(c) != "Cf").strip()


def _check_turns(turns: list[tuple[str, str]], numbers: list[int], where: Location, prompt_only: bool = False,
                 calls: dict[int, list[dict]] | None = None) -> None:  # fmt: skip
    """Alternating turns, user first, ending with a non-empty reply (``prompt_only``: ending with the user's turn);
    a reply that calls tools may be empty, and a run of ``tool`` responses takes the user's place in the
    alternation (their order: :func:`qwenkit.data.tool_turns.check_order`). ``numbers``: each turn's message number."""
    calls = calls or {}
    if turns and turns[-1][0] == "tool":
        raise BadSample(where, "turn_order", f"the last message ({numbers[-1]}) is a tool response; a "
                        "conversation must end with an assistant reply")  # fmt: skip
    kept = [k for k, (role, _) in enumerate(turns) if not (role == "tool" and k and turns[k - 1][0] == "tool")]
    roles = ["user" if turns[k][0] == "tool" else turns[k][0] for k in kept]
    if "system" in roles:
        i = numbers[kept[roles.index("system")]]
        raise BadSample(
            where, "turn_order", f"message {i} is a system message; only the first message may be one"
        )
    if "assistant" not in roles and not prompt_only:
        raise BadSample(where, "no_reply", "the conversation has no assistant reply")
    for i, role in enumerate(roles):
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            raise BadSample(
                where,
                "turn_order",
                f"message {numbers[kept[i]]} is from {turns[kept[i]][0]}, expected {expected} (turns must alternate, user first)",
            )
    if roles[-1] != "assistant" and not prompt_only:
        raise BadSample(
            where,
            "turn_order",
            f"the last message ({numbers[-1]}) is from user; a conversation must end with an assistant reply",
        )
    for i, (role, text) in enumerate(turns):
        if role == "assistant" and not visible(text) and i not in calls:
            detail = "an empty assistant reply" if not text.strip() else (
                f"an assistant reply made only of invisible characters {text!r}"
            )
            raise BadSample(where, "empty_reply", f"message {numbers[i]} is {detail}")


def _check_placeholders(
    system: str | None,
    turns: list[tuple[str, str]],
    numbers: list[int],
    placeholder: str,
    n_media: int,
    where: Location,
    read: layouts.Read,
) -> None:
    kind = placeholder.strip("<>")
    texts = ([("system", system, 0)] if system else []) + [
        (role, text, numbers[i]) for i, (role, text) in enumerate(turns)
    ]
    found = 0
    for role, text, i in texts:
        for token in SPECIAL_TOKENS:
            if token in text:
                raise BadSample(where, "bad_format", f"message {i} contains the reserved token {token!r}")
        count = text.count(placeholder)
        if count and role not in ("user", "tool"):
            raise BadSample(
                where,
                f"{kind}_count",
                f"message {i} ({role}) contains {placeholder}; {kind}s go in user messages (or tool responses)",
            )
        found += count
    if found != n_media:
        raise BadSample(
            where,
            f"{kind}_count",
            f"{found} {placeholder} placeholder{'s' if found != 1 else ''} but {n_media} {kind}{'s' if n_media != 1 else ''} "
            f"(layout {read.layout}: media from {read.media_from if kind != 'audio' else repr('audios')})",
        )
