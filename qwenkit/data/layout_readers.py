"""The readers of :mod:`qwenkit.data.layouts`: one small function per public layout, each turning a raw row
into the same :class:`Read`, and the checks they share (strings, roles, media entries, typed parts, the
grounding and ``<img>`` refusals). The table of layouts, their detection and the one entry point
(:func:`qwenkit.data.layouts.read`) are :mod:`qwenkit.data.layouts`'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from qwenkit.data import tool_turns
from qwenkit.data.report import BadSample, Location

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant",
         **{role: "tool" for role in tool_turns.RESPONSE_ROLES}}  # fmt: skip
MEDIA_KEYS = ("images", "videos", "image", "video", "audios")
QWEN_VL_TAG = re.compile(r"<img>(.*?)</img>", re.S)
GROUNDING = ("<ref-object>", "<bbox>")
REFERENCE_KEYS = ("solution", "answer")  # a prompt's reference column (TRL's, EasyR1's), the first present


@dataclass
class Read:
    """A row as every layout reads it: what :func:`qwenkit.data.conversation.parse_row` checks."""

    layout: str
    system: str | None
    messages: list[tuple[str, str]]  # (role, text) in file order; a first system message stays here
    images: list[Any] = field(default_factory=list)
    videos: list[Any] = field(default_factory=list)
    media_from: str = "'images'/'videos'"  # how messages name where the media came from
    audios: list[Any] = field(default_factory=list)  # LLaMA-Factory's / ms-swift's 'audios', in <audio> order
    tools: list[dict] = field(default_factory=list)  # the row's tool schemas (qwenkit.data.tool_turns.schemas)
    calls: dict[int, list[dict]] = field(default_factory=dict)  # messages index -> that reply's tool calls
    numbers: list[int] | None = None  # each of messages' number in the row (None: its index; ms-swift's calls join)


def bad(where: Location, detail: str, reason: str = "bad_format") -> BadSample:
    return BadSample(where, reason, detail)


def _string(value: Any, what: str, where: Location, none_as_empty: bool = False) -> str:
    if value is None and none_as_empty:
        return ""
    if not isinstance(value, str):
        raise bad(where, f"{what} must be a string, got {type(value).__name__}")
    return value


def _role(role: Any, i: int, where: Location) -> str:
    """The role a message is read as; a call message (``function_call``, ``tool_call``) keeps its own."""
    if role is None:
        raise bad(where, f"message {i} has no 'role' (or sharegpt 'from')")
    if role in tool_turns.CALL_ROLES:
        return role
    if role not in ROLES:
        raise BadSample(
            where, "bad_role", f"message {i} has role {role!r}; allowed: system, user, assistant, tool (sharegpt: human, "
            "gpt, function_call, observation; ms-swift: tool_call, tool_response)",
        )  # fmt: skip
    return ROLES[role]


def _list(row: dict, key: str, where: Location) -> list:
    raw = row[key]
    if not isinstance(raw, list) or not raw:
        raise bad(where, f"'{key}' must be a non-empty list, got {raw!r:.80}")
    return raw


def _entries(row: dict, key: str, where: Location) -> list[Any]:
    """A media key's entries as a list (a single entry may stand alone)."""
    entries = row.get(key)
    if entries is None:
        return []
    if isinstance(entries, (str, bytes, dict)):
        return [entries]
    if not isinstance(entries, list):
        raise bad(where, f"'{key}' must be a list, got {type(entries).__name__}")
    return entries


# ---------------------------------------------------------------------------------------------
# Readers


def _chat(row: dict, where: Location, key: str, role_key: str, text_key: str, calls: dict[int, list[dict]] | None = None,
          numbers: list[int] | None = None) -> list[tuple[str, str]]:  # fmt: skip
    """The string-content turns of ``row[key]``; ``calls`` and ``numbers``: where the replies' tool calls and each
    turn's message number go (the tool layouts, :mod:`qwenkit.data.tool_turns`)."""
    out: list[tuple[str, str]] = []
    calls, numbers = {} if calls is None else calls, [] if numbers is None else numbers
    for i, m in enumerate(_list(row, key, where)):
        if not isinstance(m, dict):
            raise bad(where, f"message {i} must be an object, got {type(m).__name__}")
        role = _role(m.get(role_key, m.get("role")), i, where)
        content = m.get(text_key, m.get("content"))
        if role in tool_turns.CALL_ROLES:
            tool_turns.add_message(out, calls, numbers, i, role, "", {"content": content}, where)
            continue
        if isinstance(content, list):
            raise bad(where, f"message {i} content is a list of typed parts: that is layout 'typed', not {key!r} strings")
        text = _string(content, f"message {i} content", where, none_as_empty=role == "assistant")
        tool_turns.add_message(out, calls, numbers, i, role, text, m, where)
    return out


def read_messages(row: dict, where: Location) -> Read:
    calls: dict[int, list[dict]] = {}
    numbers: list[int] = []
    return Read("messages", row.get("system"), _chat(row, where, "messages", "role", "content", calls, numbers),
                _entries(row, "images", where), _entries(row, "videos", where), audios=_entries(row, "audios", where),
                tools=tool_turns.schemas(row, where), calls=calls, numbers=numbers)  # fmt: skip


def read_sharegpt(row: dict, where: Location) -> Read:
    calls: dict[int, list[dict]] = {}
    numbers: list[int] = []
    return Read("sharegpt", row.get("system"), _chat(row, where, "conversations", "from", "value", calls, numbers),
                _entries(row, "images", where), _entries(row, "videos", where), audios=_entries(row, "audios", where),
                tools=tool_turns.schemas(row, where), calls=calls, numbers=numbers)  # fmt: skip


def _sharegpt_turns(row: dict, where: Location) -> list[tuple[str, str]]:
    """LLaVA's and Qwen-VL's turns: no tool turns (the sharegpt layout reads those)."""
    calls: dict[int, list[dict]] = {}
    turns = _chat(row, where, "conversations", "from", "value", calls)
    if calls or any(role == "tool" for role, _ in turns):
        raise bad(where, "tool calls or responses in a LLaVA / Qwen-VL row: write the row in the sharegpt layout "
                  "('images', not 'image'), which reads them")  # fmt: skip
    return turns


def read_llava(row: dict, where: Location) -> Read:
    return Read("llava", row.get("system"), _sharegpt_turns(row, where),
                _entries(row, "image", where), _entries(row, "video", where), "'image'/'video'")  # fmt: skip


def read_qwen_vl(row: dict, where: Location) -> Read:
    """``<img>path</img>`` in a turn is an image at that place (Qwen-VL v1's own convention)."""
    images: list[str] = []
    turns = []
    for role, text in _sharegpt_turns(row, where):
        images.extend(QWEN_VL_TAG.findall(text))
        turns.append((role, QWEN_VL_TAG.sub(IMAGE_PLACEHOLDER, text)))
    return Read("qwen_vl", row.get("system"), turns, images, [], "<img> tags")


def _part(part: Any, i: int, k: int, where: Location) -> tuple[str, Any]:
    """``("text", str)``, ``("image", source or None)`` or ``("video", source or None)``."""
    if isinstance(part, str):
        return "text", part
    if not isinstance(part, dict):
        raise bad(where, f"message {i} part {k} must be an object, got {type(part).__name__}")
    part = {key: v for key, v in part.items() if v is not None}  # Arrow structs carry every field, mostly None
    kind = part.get("type")
    # the order of Qwen2.5-VL's chat template: image (by type or key), then video, then text
    if kind in ("image", "image_url") or "image" in part or "image_url" in part:
        source = part.get("image", part.get("image_url", part.get("value", part.get("url", part.get("path")))))
        if isinstance(source, dict) and "url" in source:  # OpenAI: {"image_url": {"url": ...}}
            source = source["url"]
        return "image", source
    if kind == "video" or "video" in part:
        source = part.get("video", part.get("value", part.get("path")))
        if isinstance(source, list):  # a list of frame files (qwen-vl-utils, LLaMA-Factory)
            fps = part.get("sample_fps", part.get("fps"))
            if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
                raise bad(where, f"message {i} part {k}: 'fps' must be a positive number, got {fps!r}")
            source = {"frames": source, "fps": fps}
        return "video", source
    if kind == "text" or (kind is None and ("text" in part or "value" in part)):
        return "text", _string(part.get("text", part.get("value", "")), f"message {i} part {k} text", where)
    raise bad(where, f"message {i} part {k} has type {kind!r}; qwenkit reads text, image, image_url and video parts")


def read_typed(row: dict, where: Location) -> Read:
    """Typed parts, rendered as Qwen2.5-VL's chat template renders them: parts concatenated, each
    image part one vision span, each text part its text. A part without a source (TRL's
    ``{"type": "image"}``) takes the next entry of the row's ``images``."""
    column = {"image": list(_entries(row, "images", where)), "video": list(_entries(row, "videos", where))}
    sourceless = {"image": 0, "video": 0}
    media: dict[str, list] = {"image": [], "video": []}
    turns: list[tuple[str, str]] = []
    calls: dict[int, list[dict]] = {}
    numbers: list[int] = []
    for i, m in enumerate(_list(row, "messages", where)):
        if not isinstance(m, dict):
            raise bad(where, f"message {i} must be an object, got {type(m).__name__}")
        role = _role(m.get("role"), i, where)
        weight = m.get("loss_weight")
        if weight is not None and weight != (1.0 if role == "assistant" else 0.0):
            raise bad(
                where,
                f"message {i} ({role}) has loss_weight={weight!r}; qwenkit learns every assistant reply and nothing "
                "else (loss_weight 1.0 on assistant, 0.0 elsewhere)",
            )
        content = m.get("content")
        if role in tool_turns.CALL_ROLES:
            tool_turns.add_message(turns, calls, numbers, i, role, "", m, where)
            continue
        if isinstance(content, str) or (content is None and role == "assistant"):
            tool_turns.add_message(turns, calls, numbers, i, role, content or "", m, where)
            continue
        if not isinstance(content, list):
            raise bad(where, f"message {i} content must be a string or a list of parts, got {type(content).__name__}")
        pieces = []
        for k, part in enumerate(content):
            kind, source = _part(part, i, k, where)
            if kind == "text":
                pieces.append(source)
                continue
            if source is None:
                sourceless[kind] += 1
                if not column[kind]:
                    raise BadSample(
                        where,
                        f"{kind}_count",
                        f"message {i} part {k} is {'an' if kind == 'image' else 'a'} {kind} part without a source, and the row's '{kind}s' has "
                        f"only {sourceless[kind] - 1} entr{'y' if sourceless[kind] == 2 else 'ies'} (layout typed)",
                    )
                source = column[kind].pop(0)
            media[kind].append(source)
            pieces.append(IMAGE_PLACEHOLDER if kind == "image" else VIDEO_PLACEHOLDER)
        tool_turns.add_message(turns, calls, numbers, i, role, "".join(pieces), m, where)
    for kind, left in column.items():
        if left:
            raise BadSample(
                where,
                f"{kind}_count",
                f"{sourceless[kind]} {kind} part{'s' if sourceless[kind] != 1 else ''} without a source but "
                f"{sourceless[kind] + len(left)} entries in '{kind}s' (layout typed)",
            )
    return Read("typed", row.get("system"), turns, media["image"], media["video"], "image/video parts",
                tools=tool_turns.schemas(row, where), calls=calls, numbers=numbers)  # fmt: skip


def _pairs(pairs: Any, what: str, where: Location) -> list[tuple[str, str]]:
    """``[[query, response], ...]`` history turns."""
    if pairs is None:
        return []
    if not isinstance(pairs, list):
        raise bad(where, f"'{what}' must be a list of [query, response] pairs, got {type(pairs).__name__}")
    turns = []
    for k, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise bad(where, f"'{what}' entry {k} must be a [query, response] pair, got {pair!r:.80}")
        turns += [("user", _string(pair[0], f"{what} {k} query", where)),
                  ("assistant", _string(pair[1], f"{what} {k} response", where))]  # fmt: skip
    return turns


def read_swift_conversation(row: dict, where: Location) -> Read:
    turns = []
    for k, pair in enumerate(_list(row, "conversation", where)):
        if not isinstance(pair, dict) or "human" not in pair or "assistant" not in pair:
            raise bad(where, f"'conversation' entry {k} must be {{\"human\": ..., \"assistant\": ...}}, got {pair!r:.80}")
        turns += [("user", _string(pair["human"], f"conversation {k} human", where)),
                  ("assistant", _string(pair["assistant"], f"conversation {k} assistant", where))]  # fmt: skip
    return Read("swift_conversation", row.get("system"), turns,
                _entries(row, "images", where), _entries(row, "videos", where), audios=_entries(row, "audios", where))  # fmt: skip


def read_swift_query(row: dict, where: Location) -> Read:
    turns = _pairs(row.get("history"), "history", where)
    turns += [("user", _string(row.get("query"), "'query'", where)),
              ("assistant", _string(row.get("response"), "'response'", where, none_as_empty=True))]  # fmt: skip
    return Read("swift_query", row.get("system"), turns,
                _entries(row, "images", where), _entries(row, "videos", where), audios=_entries(row, "audios", where))  # fmt: skip


def read_alpaca(row: dict, where: Location) -> Read:
    """LLaMA-Factory's alpaca: the user turn is ``instruction`` and ``input`` joined by a newline."""
    query = [_string(row[key], f"'{key}'", where) for key in ("instruction", "input") if row.get(key)]
    turns = _pairs(row.get("history"), "history", where)
    turns += [("user", "\n".join(query)), ("assistant", _string(row.get("output"), "'output'", where, True))]
    return Read("alpaca", row.get("system"), turns, _entries(row, "images", where), _entries(row, "videos", where),
                audios=_entries(row, "audios", where))  # fmt: skip


def read_cauldron(row: dict, where: Location) -> Read:
    """the_cauldron: no placeholders; every image of the row goes before the first user turn."""
    images = _entries(row, "images", where)
    turns = []
    for k, t in enumerate(_list(row, "texts", where)):
        if not isinstance(t, dict) or "user" not in t or "assistant" not in t:
            raise bad(where, f"'texts' entry {k} must be {{\"user\": ..., \"assistant\": ...}}, got {t!r:.80}")
        user = _string(t["user"], f"texts {k} user", where)
        turns += [("user", (IMAGE_PLACEHOLDER * len(images) if k == 0 else "") + user),
                  ("assistant", _string(t["assistant"], f"texts {k} assistant", where))]  # fmt: skip
    return Read("cauldron", None, turns, images, [], "'images' (before the first user turn)")


def read_prompt(row: dict, where: Location) -> Read:
    """A prompt alone (its reference: the ``solution`` / ``answer`` column): EasyR1's ``problem`` or TRL's
    ``prompt`` text, media without placeholders before it; or TRL's conversational ``prompt`` (messages)."""
    if "chosen" in row or "rejected" in row:
        raise bad(where, "a preference row (prompt/chosen/rejected): train.objective=dpo reads it")
    key, images = "problem" if "problem" in row else "prompt", _entries(row, "images", where) + _entries(row, "image", where)
    if isinstance(row[key], list):  # conversational: messages as the typed layout reads them
        typed = read_typed({"messages": row[key], "images": images, "videos": row.get("videos")}, where)
        return replace(typed, layout="prompt", system=row.get("system"))
    text, videos = _string(row[key], repr(key), where), _entries(row, "videos", where)
    if IMAGE_PLACEHOLDER not in text and VIDEO_PLACEHOLDER not in text:
        text = IMAGE_PLACEHOLDER * len(images) + VIDEO_PLACEHOLDER * len(videos) + text
    return Read("prompt", row.get("system"), [("user", text)], images, videos, "'images'/'image'/'videos'")

