"""One raw row → a validated :class:`Conversation` (roles, turn order, replies, placeholders).

Accepted layouts, as written by LLaMA-Factory, MindSpeed-MM and ms-swift:

- ``{"messages": [{"role": "user", "content": "<image>..."}, ...], "images": [...]}``
- sharegpt: ``{"conversations": [{"from": "human", "value": "..."}, ...], "images": [...]}``,
  roles ``human``/``gpt``/``system``, optionally a top-level ``"system"`` string.

Either layout may carry ``"videos": [...]`` with ``<video>`` placeholders, alone or mixed with
images: the k-th ``<image>`` is ``images[k]`` and the k-th ``<video>`` is ``videos[k]``.

An optional ``"id"`` field is carried into error messages. Every problem raises
:class:`~qwenkit.data.report.BadSample` naming the message index (counting from 0).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qwenkit.data.report import BadSample, Location
from qwenkit.model.processor import SPECIAL_TOKENS

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}


@dataclass
class Conversation:
    """A checked conversation: optional system text, then (role, text) turns user/assistant alternating."""

    where: Location
    system: str | None
    turns: list[tuple[str, str]]
    images: list[Any]  # raw image entries, in placeholder order; see qwenkit.data.images
    videos: list[Any] = dataclasses.field(default_factory=list)  # raw video entries; see qwenkit.data.video


def parse_row(row: Any, where: Location) -> Conversation:
    if not isinstance(row, dict):
        raise BadSample(where, "bad_format", f"a row must be a JSON object, got {type(row).__name__}")
    if isinstance(row.get("id"), (str, int)) and not isinstance(row.get("id"), bool):
        where = dataclasses.replace(where, id=str(row["id"]))
    messages = _messages(row, where)
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise BadSample(where, "bad_format", f"'system' must be a string, got {type(system).__name__}")
    if messages and messages[0][0] == "system":
        if system:
            raise BadSample(where, "bad_format", "both a 'system' field and a system message; keep one")
        system = messages[0][1]
        messages = messages[1:]
        offset = 1
    else:
        offset = 0
    _check_turns(messages, offset, where)
    images = _media(row, "images", where)
    videos = _media(row, "videos", where)
    _check_placeholders(system, messages, offset, IMAGE_PLACEHOLDER, len(images), where)
    _check_placeholders(system, messages, offset, VIDEO_PLACEHOLDER, len(videos), where)
    return Conversation(where, system or None, messages, images, videos)


def _messages(row: dict, where: Location) -> list[tuple[str, str]]:
    key = "messages" if "messages" in row else "conversations" if "conversations" in row else None
    if key is None:
        raise BadSample(
            where, "bad_format", f"no 'messages' or 'conversations' list; the row has keys {sorted(row)}"
        )
    raw = row[key]
    if not isinstance(raw, list) or not raw:
        raise BadSample(where, "bad_format", f"'{key}' must be a non-empty list, got {raw!r:.80}")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadSample(where, "bad_format", f"message {i} must be an object, got {type(m).__name__}")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        if role is None:
            raise BadSample(where, "bad_format", f"message {i} has no 'role' (or sharegpt 'from')")
        if role not in ROLES:
            raise BadSample(
                where,
                "bad_role",
                f"message {i} has role {role!r}; allowed: system, user, assistant (sharegpt: human, gpt)",
            )
        role = ROLES[role]
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise BadSample(
                where, "bad_format", f"message {i} content must be a string, got {type(content).__name__}"
            )
        out.append((role, content))
    return out


def _check_turns(turns: list[tuple[str, str]], offset: int, where: Location) -> None:
    roles = [role for role, _ in turns]
    if "system" in roles:
        i = roles.index("system") + offset
        raise BadSample(
            where, "turn_order", f"message {i} is a system message; only the first message may be one"
        )
    if "assistant" not in roles:
        raise BadSample(where, "no_reply", "the conversation has no assistant reply")
    for i, role in enumerate(roles):
        expected = "user" if i % 2 == 0 else "assistant"
        if role != expected:
            raise BadSample(
                where,
                "turn_order",
                f"message {i + offset} is from {role}, expected {expected} (turns must alternate, user first)",
            )
    if roles[-1] != "assistant":
        raise BadSample(
            where,
            "turn_order",
            f"the last message ({len(roles) - 1 + offset}) is from user; a conversation must end with an assistant reply",
        )
    for i, (role, text) in enumerate(turns):
        if role == "assistant" and not text.strip():
            raise BadSample(where, "empty_reply", f"message {i + offset} is an empty assistant reply")


def _media(row: dict, key: str, where: Location) -> list[Any]:
    """The row's ``images`` or ``videos`` entries as a list (a single entry may stand alone)."""
    entries = row.get(key)
    if entries is None:
        return []
    if isinstance(entries, (str, bytes, dict)):
        return [entries]
    if not isinstance(entries, list):
        raise BadSample(where, "bad_format", f"'{key}' must be a list, got {type(entries).__name__}")
    return entries


def _check_placeholders(
    system: str | None, turns: list[tuple[str, str]], offset: int, placeholder: str, n_media: int, where: Location
) -> None:
    kind = "image" if placeholder == IMAGE_PLACEHOLDER else "video"
    texts = ([("system", system, 0)] if system else []) + [
        (role, text, i + offset) for i, (role, text) in enumerate(turns)
    ]
    found = 0
    for role, text, i in texts:
        for token in SPECIAL_TOKENS:
            if token in text:
                raise BadSample(where, "bad_format", f"message {i} contains the reserved token {token!r}")
        count = text.count(placeholder)
        if count and role != "user":
            raise BadSample(
                where,
                f"{kind}_count",
                f"message {i} ({role}) contains {placeholder}; {kind}s go in user messages",
            )
        found += count
    if found != n_media:
        raise BadSample(
            where,
            f"{kind}_count",
            f"{found} {placeholder} placeholder{'s' if found != 1 else ''} but {n_media} {kind}{'s' if n_media != 1 else ''}",
        )
