"""Dataset layouts: one small reader per public layout, each turning a raw row into the same
:class:`Read` (system text, ``(role, text)`` turns with ``<image>``/``<video>`` placeholders,
and the row's image and video entries in placeholder order).

Everything after reading (the checks of :mod:`qwenkit.data.conversation`, the template, the
index, the cache, the bad-sample report, packing, evaluation) sees only that result, so a
layout changes nothing downstream. ``data.layout: auto`` picks the layout of each row from its
keys (:func:`detect`); a named layout refuses rows that do not fit it, naming the key found.

=================  ==========================================================================
layout             rows as written by
=================  ==========================================================================
``messages``       LLaMA-Factory / ms-swift: ``messages`` with string contents, ``images``, ``videos``
``sharegpt``       LLaMA-Factory sharegpt: ``conversations`` (``from``/``value``), ``images``, ``videos``
``llava``          LLaVA-1.5, ShareGPT4V, LLaVA-OneVision, InternVL jsonl, Qwen's qwen-vl-finetune:
                   ``conversations`` with a singular ``image`` (string or list) / ``video``
``typed``          HF / TRL / qwen-vl-utils / OpenAI / LLaMA-Factory v1: ``messages`` whose contents
                   are lists of typed parts (``text``, ``image``, ``image_url``, ``video``; ``text``
                   or ``value``); a bare ``{"type": "image"}`` takes the next entry of ``images``
``qwen_vl``        Qwen-VL (v1): ``conversations`` with ``<img>path</img>`` tags in the text
``swift_conversation``  ms-swift: ``conversation: [{"human", "assistant"}]`` pairs (+ ``system``)
``swift_query``    ms-swift: ``query`` / ``response`` / ``history`` (+ ``system``)
``alpaca``         LLaMA-Factory alpaca: ``instruction`` / ``input`` / ``output`` (+ ``system``, ``history``)
``cauldron``       HuggingFaceM4 the_cauldron: ``images`` + ``texts: [{"user", "assistant"}]``;
                   the images go before the first user turn
``prompt``         GRPO's prompts alone: EasyR1's ``problem`` / TRL's ``prompt`` (text, or messages)
                   + ``answer`` / ``solution``, ``images`` / ``image`` / ``videos``; media
                   without placeholders go before the text (as TRL's processor puts them)
=================  ==========================================================================

Every layout also reads a ``solution`` / ``answer`` column (:data:`REFERENCE_KEYS`): GRPO's
reference where a row has one, and a prompt alone is then a row
(:func:`qwenkit.data.conversation.parse_row`).

Refused, naming the row, because reading them as text would train wrongly: ms-swift grounding
rows (``objects``, ``<ref-object>``/``<bbox>``), ``<img>`` tags in any other layout, tool
definitions (``tools``), a ``loss_weight`` that differs from "learn the replies only", and a
media key that the row's layout does not take (``image`` in a ``messages`` row, ...). Which layouts
a dataset's files hold, and the keys no reader reads: :mod:`qwenkit.data.layout_survey`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from qwenkit.data.report import BadSample, Location

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
MEDIA_KEYS = ("images", "videos", "image", "video")
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


@dataclass(frozen=True)
class Layout:
    name: str
    describe: str  # what data check prints after the name
    turns: tuple[str, ...]  # a row of this layout has one of these keys
    media: tuple[str, ...]  # the media keys it reads
    keys: frozenset[str]  # every top-level key it reads
    message_keys: frozenset[str]  # keys it reads inside a message (or turn)
    read: Callable[[dict, Location], Read]


def _bad(where: Location, detail: str, reason: str = "bad_format") -> BadSample:
    return BadSample(where, reason, detail)


def _string(value: Any, what: str, where: Location, none_as_empty: bool = False) -> str:
    if value is None and none_as_empty:
        return ""
    if not isinstance(value, str):
        raise _bad(where, f"{what} must be a string, got {type(value).__name__}")
    return value


def _role(role: Any, i: int, where: Location) -> str:
    if role is None:
        raise _bad(where, f"message {i} has no 'role' (or sharegpt 'from')")
    if role not in ROLES:
        raise BadSample(
            where, "bad_role", f"message {i} has role {role!r}; allowed: system, user, assistant (sharegpt: human, gpt)"
        )
    return ROLES[role]


def _list(row: dict, key: str, where: Location) -> list:
    raw = row[key]
    if not isinstance(raw, list) or not raw:
        raise _bad(where, f"'{key}' must be a non-empty list, got {raw!r:.80}")
    return raw


def _entries(row: dict, key: str, where: Location) -> list[Any]:
    """A media key's entries as a list (a single entry may stand alone)."""
    entries = row.get(key)
    if entries is None:
        return []
    if isinstance(entries, (str, bytes, dict)):
        return [entries]
    if not isinstance(entries, list):
        raise _bad(where, f"'{key}' must be a list, got {type(entries).__name__}")
    return entries


# ---------------------------------------------------------------------------------------------
# Readers


def _chat(row: dict, where: Location, key: str, role_key: str, text_key: str) -> list[tuple[str, str]]:
    out = []
    for i, m in enumerate(_list(row, key, where)):
        if not isinstance(m, dict):
            raise _bad(where, f"message {i} must be an object, got {type(m).__name__}")
        role = _role(m.get(role_key), i, where)
        content = m.get(text_key)
        if isinstance(content, list):
            raise _bad(where, f"message {i} content is a list of typed parts: that is layout 'typed', not {key!r} strings")
        out.append((role, _string(content, f"message {i} content", where, none_as_empty=role == "assistant")))
    return out


def read_messages(row: dict, where: Location) -> Read:
    return Read("messages", row.get("system"), _chat(row, where, "messages", "role", "content"),
                _entries(row, "images", where), _entries(row, "videos", where))  # fmt: skip


def read_sharegpt(row: dict, where: Location) -> Read:
    return Read("sharegpt", row.get("system"), _sharegpt_turns(row, where),
                _entries(row, "images", where), _entries(row, "videos", where))  # fmt: skip


def _sharegpt_turns(row: dict, where: Location) -> list[tuple[str, str]]:
    out = []
    for i, m in enumerate(_list(row, "conversations", where)):
        if not isinstance(m, dict):
            raise _bad(where, f"message {i} must be an object, got {type(m).__name__}")
        role = _role(m.get("from", m.get("role")), i, where)
        content = m.get("value", m.get("content"))
        out.append((role, _string(content, f"message {i} content", where, none_as_empty=role == "assistant")))
    return out


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
        raise _bad(where, f"message {i} part {k} must be an object, got {type(part).__name__}")
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
                raise _bad(where, f"message {i} part {k}: 'fps' must be a positive number, got {fps!r}")
            source = {"frames": source, "fps": fps}
        return "video", source
    if kind == "text" or (kind is None and ("text" in part or "value" in part)):
        return "text", _string(part.get("text", part.get("value", "")), f"message {i} part {k} text", where)
    raise _bad(where, f"message {i} part {k} has type {kind!r}; qwenkit reads text, image, image_url and video parts")


def read_typed(row: dict, where: Location) -> Read:
    """Typed parts, rendered as Qwen2.5-VL's chat template renders them: parts concatenated, each
    image part one vision span, each text part its text. A part without a source (TRL's
    ``{"type": "image"}``) takes the next entry of the row's ``images``."""
    column = {"image": list(_entries(row, "images", where)), "video": list(_entries(row, "videos", where))}
    sourceless = {"image": 0, "video": 0}
    media: dict[str, list] = {"image": [], "video": []}
    turns = []
    for i, m in enumerate(_list(row, "messages", where)):
        if not isinstance(m, dict):
            raise _bad(where, f"message {i} must be an object, got {type(m).__name__}")
        role = _role(m.get("role"), i, where)
        weight = m.get("loss_weight")
        if weight is not None and weight != (1.0 if role == "assistant" else 0.0):
            raise _bad(
                where,
                f"message {i} ({role}) has loss_weight={weight!r}; qwenkit learns every assistant reply and nothing "
                "else (loss_weight 1.0 on assistant, 0.0 elsewhere)",
            )
        content = m.get("content")
        if isinstance(content, str) or (content is None and role == "assistant"):
            turns.append((role, content or ""))
            continue
        if not isinstance(content, list):
            raise _bad(where, f"message {i} content must be a string or a list of parts, got {type(content).__name__}")
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
        turns.append((role, "".join(pieces)))
    for kind, left in column.items():
        if left:
            raise BadSample(
                where,
                f"{kind}_count",
                f"{sourceless[kind]} {kind} part{'s' if sourceless[kind] != 1 else ''} without a source but "
                f"{sourceless[kind] + len(left)} entries in '{kind}s' (layout typed)",
            )
    return Read("typed", row.get("system"), turns, media["image"], media["video"], "image/video parts")


def _pairs(pairs: Any, what: str, where: Location) -> list[tuple[str, str]]:
    """``[[query, response], ...]`` history turns."""
    if pairs is None:
        return []
    if not isinstance(pairs, list):
        raise _bad(where, f"'{what}' must be a list of [query, response] pairs, got {type(pairs).__name__}")
    turns = []
    for k, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _bad(where, f"'{what}' entry {k} must be a [query, response] pair, got {pair!r:.80}")
        turns += [("user", _string(pair[0], f"{what} {k} query", where)),
                  ("assistant", _string(pair[1], f"{what} {k} response", where))]  # fmt: skip
    return turns


def read_swift_conversation(row: dict, where: Location) -> Read:
    turns = []
    for k, pair in enumerate(_list(row, "conversation", where)):
        if not isinstance(pair, dict) or "human" not in pair or "assistant" not in pair:
            raise _bad(where, f"'conversation' entry {k} must be {{\"human\": ..., \"assistant\": ...}}, got {pair!r:.80}")
        turns += [("user", _string(pair["human"], f"conversation {k} human", where)),
                  ("assistant", _string(pair["assistant"], f"conversation {k} assistant", where))]  # fmt: skip
    return Read("swift_conversation", row.get("system"), turns,
                _entries(row, "images", where), _entries(row, "videos", where))  # fmt: skip


def read_swift_query(row: dict, where: Location) -> Read:
    turns = _pairs(row.get("history"), "history", where)
    turns += [("user", _string(row.get("query"), "'query'", where)),
              ("assistant", _string(row.get("response"), "'response'", where, none_as_empty=True))]  # fmt: skip
    return Read("swift_query", row.get("system"), turns,
                _entries(row, "images", where), _entries(row, "videos", where))  # fmt: skip


def read_alpaca(row: dict, where: Location) -> Read:
    """LLaMA-Factory's alpaca: the user turn is ``instruction`` and ``input`` joined by a newline."""
    query = [_string(row[key], f"'{key}'", where) for key in ("instruction", "input") if row.get(key)]
    turns = _pairs(row.get("history"), "history", where)
    turns += [("user", "\n".join(query)), ("assistant", _string(row.get("output"), "'output'", where, True))]
    return Read("alpaca", row.get("system"), turns, _entries(row, "images", where), _entries(row, "videos", where))


def read_cauldron(row: dict, where: Location) -> Read:
    """the_cauldron: no placeholders; every image of the row goes before the first user turn."""
    images = _entries(row, "images", where)
    turns = []
    for k, t in enumerate(_list(row, "texts", where)):
        if not isinstance(t, dict) or "user" not in t or "assistant" not in t:
            raise _bad(where, f"'texts' entry {k} must be {{\"user\": ..., \"assistant\": ...}}, got {t!r:.80}")
        user = _string(t["user"], f"texts {k} user", where)
        turns += [("user", (IMAGE_PLACEHOLDER * len(images) if k == 0 else "") + user),
                  ("assistant", _string(t["assistant"], f"texts {k} assistant", where))]  # fmt: skip
    return Read("cauldron", None, turns, images, [], "'images' (before the first user turn)")


def read_prompt(row: dict, where: Location) -> Read:
    """A prompt alone (its reference: the ``solution`` / ``answer`` column): EasyR1's ``problem`` or TRL's
    ``prompt`` text, media without placeholders before it; or TRL's conversational ``prompt`` (messages)."""
    if "chosen" in row or "rejected" in row:
        raise _bad(where, "a preference row (prompt/chosen/rejected): train.objective=dpo reads it")
    key, images = "problem" if "problem" in row else "prompt", _entries(row, "images", where) + _entries(row, "image", where)
    if isinstance(row[key], list):  # conversational: messages as the typed layout reads them
        typed = read_typed({"messages": row[key], "images": images, "videos": row.get("videos")}, where)
        return replace(typed, layout="prompt", system=row.get("system"))
    text, videos = _string(row[key], repr(key), where), _entries(row, "videos", where)
    if IMAGE_PLACEHOLDER not in text and VIDEO_PLACEHOLDER not in text:
        text = IMAGE_PLACEHOLDER * len(images) + VIDEO_PLACEHOLDER * len(videos) + text
    return Read("prompt", row.get("system"), [("user", text)], images, videos, "'images'/'image'/'videos'")


def _layout(name, describe, turns, media, keys, message_keys, read) -> Layout:
    keys = frozenset(keys) | {"id", *REFERENCE_KEYS}
    return Layout(name, describe, turns, media, keys, frozenset(message_keys), read)


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        _layout("messages", "messages/images", ("messages",), ("images", "videos"),
                ("messages", "images", "videos", "system"), ("role", "content"), read_messages),
        _layout("sharegpt", "conversations/images", ("conversations",), ("images", "videos"),
                ("conversations", "images", "videos", "system"), ("from", "value", "role", "content"), read_sharegpt),
        _layout("llava", "image/conversations", ("conversations",), ("image", "video"),
                ("conversations", "image", "video", "system"), ("from", "value", "role", "content"), read_llava),
        _layout("typed", "typed content parts", ("messages",), ("images", "videos"),
                ("messages", "images", "videos", "system"), ("role", "content", "loss_weight"), read_typed),
        _layout("qwen_vl", "<img> tags in conversations", ("conversations",), (),
                ("conversations", "system"), ("from", "value", "role", "content"), read_qwen_vl),
        _layout("swift_conversation", "conversation pairs", ("conversation",), ("images", "videos"),
                ("conversation", "images", "videos", "system"), ("human", "assistant"), read_swift_conversation),
        _layout("swift_query", "query/response/history", ("query",), ("images", "videos"),
                ("query", "response", "history", "images", "videos", "system"), (), read_swift_query),
        _layout("alpaca", "instruction/input/output", ("instruction", "output"), ("images", "videos"),
                ("instruction", "input", "output", "history", "images", "videos", "system"), (), read_alpaca),
        _layout("cauldron", "images/texts", ("texts",), ("images",), ("images", "texts"),
                ("user", "assistant"), read_cauldron),
        _layout("prompt", "prompts alone (GRPO)", ("problem", "prompt"), ("images", "image", "videos"),
                ("problem", "prompt", "images", "image", "videos", "system"), (), read_prompt),
    )
}  # fmt: skip
NAMES = ("auto", *LAYOUTS)


def _texts(row: dict, key: str) -> list[str]:
    turns = row.get(key)
    if not isinstance(turns, list):
        return []
    return [v for m in turns if isinstance(m, dict) for v in m.values() if isinstance(v, str)]


def _typed(row: dict) -> bool:
    turns = row.get("messages")
    return isinstance(turns, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in turns)


def detect(row: dict) -> str | None:
    """The layout of one row by its keys, or None when no layout has its keys."""
    if "messages" in row:
        return "typed" if _typed(row) else "messages"
    if "conversations" in row:
        if "image" in row or "video" in row:
            return "llava"
        if not any(k in row for k in MEDIA_KEYS) and any(QWEN_VL_TAG.search(t) for t in _texts(row, "conversations")):
            return "qwen_vl"
        return "sharegpt"
    for layout in LAYOUTS.values():
        if any(k in row for k in layout.turns):
            return layout.name
    return None


def _fit(row: dict, layout: Layout, forced: bool, where: Location) -> None:
    """Refuse a row that carries a key its layout does not read in a way that would mis-train."""
    assumed = f"data.layout={layout.name}" if forced else f"layout {layout.name} (detected)"
    if not any(k in row for k in layout.turns):
        found = detect(row)
        raise _bad(
            where,
            f"{assumed} expects {' or '.join(repr(k) for k in layout.turns)}; the row has keys {sorted(row)}"
            + (f" (layout {found})" if found else ""),
        )
    for key in MEDIA_KEYS:
        if key in row and key not in layout.media:
            takes = f"takes media from {' and '.join(repr(k) for k in layout.media)}" if layout.media else "takes no media key"
            raise _bad(where, f"the row has {key!r}, but {assumed} {takes}; its {key!r} would be dropped")
    if "objects" in row:
        raise _bad(
            where,
            "the row has 'objects' (ms-swift grounding): qwenkit does not fill <ref-object>/<bbox> from it; write the "
            "references and boxes into the text in the family's coordinates (Qwen2.5-VL: absolute pixels of the resized "
            "image; Qwen3-VL and Qwen3.5: relative, 0-1000)",
        )
    if row.get("tools"):
        raise _bad(where, "the row has 'tools' (agent tool definitions); qwenkit's template does not render them")


def read(row: dict, where: Location, layout: str = "auto") -> Read:
    """``row`` read by ``layout`` (``auto``: :func:`detect`); raises :class:`BadSample` naming the layout."""
    name = detect(row) if layout == "auto" else layout
    if name is None:
        raise _bad(
            where,
            f"no layout has this row's keys {sorted(row)}; known: {', '.join(LAYOUTS)} (see docs/DATA.md)",
        )
    if layout != "auto" and name == "messages" and _typed(row):
        raise _bad(where, "data.layout=messages, but message contents are lists of typed parts (layout typed)")
    spec = LAYOUTS[name]
    _fit(row, spec, layout != "auto", where)
    result = spec.read(row, where)
    if result.system is not None and not isinstance(result.system, str):
        raise _bad(where, f"'system' must be a string, got {type(result.system).__name__}")
    for i, (_, text) in enumerate(result.messages):
        for tag in GROUNDING:
            if tag in text:
                raise _bad(
                    where,
                    f"message {i} contains {tag} (an ms-swift grounding placeholder): qwenkit does not fill it; write "
                    "the reference and box into the text",
                )
        if name != "qwen_vl" and QWEN_VL_TAG.search(text):
            raise _bad(
                where,
                f"message {i} contains a Qwen-VL <img>...</img> tag, but layout {name} takes images from "
                f"{result.media_from}; the tag would be trained as text (rows with <img> tags and no media key are "
                "read as layout qwen_vl)",
            )
    return result
