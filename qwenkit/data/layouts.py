"""Dataset layouts: one small reader per public layout, each turning a raw row into the same
:class:`Read` (system text, ``(role, text)`` turns with ``<image>``/``<video>``/``<audio>`` placeholders,
and the row's image, video and audio entries in placeholder order).

Everything after reading (the checks of :mod:`qwenkit.data.conversation`, the template, the
index, the cache, the bad-sample report, packing, evaluation) sees only that result, so a
layout changes nothing downstream. ``data.layout: auto`` picks the layout of each row from its
keys (:func:`detect`); a named layout refuses rows that do not fit it, naming the key found.

=================  ==========================================================================
layout             rows as written by
=================  ==========================================================================
``messages``       LLaMA-Factory / ms-swift: ``messages`` with string contents, ``images``, ``videos``, ``audios``
``sharegpt``       LLaMA-Factory sharegpt: ``conversations`` (``from``/``value``), ``images``, ``videos``, ``audios``
``llava``          LLaVA-1.5, ShareGPT4V, LLaVA-OneVision, InternVL jsonl, Qwen's qwen-vl-finetune:
                   ``conversations`` with a singular ``image`` (string or list) / ``video``
``typed``          HF / TRL / qwen-vl-utils / OpenAI / LLaMA-Factory v1: ``messages`` whose contents
                   are lists of typed parts (``text``, ``image``, ``image_url``, ``video``; ``text``
                   or ``value``); a bare ``{"type": "image"}`` takes the next entry of ``images``
``qwen_vl``        Qwen-VL (v1): ``conversations`` with ``<img>path</img>`` tags in the text
``swift_conversation``  ms-swift: ``conversation: [{"human", "assistant"}]`` pairs (+ ``system``)
``swift_query``    ms-swift: ``query`` / ``response`` / ``history`` (+ ``system``)
``alpaca``         LLaMA-Factory alpaca: ``instruction`` / ``input`` / ``output`` (+ ``system``, ``history``,
                   ``images``, ``videos``, ``audios``)
``cauldron``       HuggingFaceM4 the_cauldron: ``images`` + ``texts: [{"user", "assistant"}]``;
                   the images go before the first user turn
``prompt``         GRPO's prompts alone: EasyR1's ``problem`` / TRL's ``prompt`` (text, or messages)
                   + ``answer`` / ``solution``, ``images`` / ``image`` / ``videos``; media
                   without placeholders go before the text (as TRL's processor puts them)
=================  ==========================================================================

The two ms-swift layouts read ``images``, ``videos`` and ``audios`` too. Every layout also reads a ``solution`` / ``answer`` column (:data:`REFERENCE_KEYS`): GRPO's
reference where a row has one, and a prompt alone is then a row
(:func:`qwenkit.data.conversation.parse_row`).

Refused, naming the row, because reading them as text would train wrongly: ms-swift grounding
rows (``objects``, ``<ref-object>``/``<bbox>``), ``<img>`` tags in any other layout, tool
definitions (``tools``) in a layout other than ``messages``, ``typed`` and ``sharegpt`` (which read tool rows:
:mod:`qwenkit.data.tool_turns`), a ``loss_weight`` that differs from "learn the replies only", and a
media key that the row's layout does not take (``image`` in a ``messages`` row, ...). Which layouts
a dataset's files hold, and the keys no reader reads: :mod:`qwenkit.data.layout_survey`.

The readers themselves, and the checks they share: :mod:`qwenkit.data.layout_readers`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qwenkit.data.layout_readers import (
    GROUNDING,
    MEDIA_KEYS,
    QWEN_VL_TAG,
    REFERENCE_KEYS,
    Read,
    bad,
    read_alpaca,
    read_cauldron,
    read_llava,
    read_messages,
    read_prompt,
    read_qwen_vl,
    read_sharegpt,
    read_swift_conversation,
    read_swift_query,
    read_typed,
)
from qwenkit.data.report import Location


@dataclass(frozen=True)
class Layout:
    name: str
    describe: str  # what data check prints after the name
    turns: tuple[str, ...]  # a row of this layout has one of these keys
    media: tuple[str, ...]  # the media keys it reads
    keys: frozenset[str]  # every top-level key it reads
    message_keys: frozenset[str]  # keys it reads inside a message (or turn)
    read: Callable[[dict, Location], Read]





def _layout(name, describe, turns, media, keys, message_keys, read) -> Layout:
    keys = frozenset(keys) | {"id", *REFERENCE_KEYS}
    return Layout(name, describe, turns, media, keys, frozenset(message_keys), read)


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        _layout("messages", "messages/images", ("messages",), ("images", "videos", "audios"),
                ("messages", "images", "videos", "audios", "system", "tools"), ("role", "content", "tool_calls"), read_messages),
        _layout("sharegpt", "conversations/images", ("conversations",), ("images", "videos", "audios"),
                ("conversations", "images", "videos", "audios", "system", "tools"), ("from", "value", "role", "content"),
                read_sharegpt),
        _layout("llava", "image/conversations", ("conversations",), ("image", "video"),
                ("conversations", "image", "video", "system"), ("from", "value", "role", "content"), read_llava),
        _layout("typed", "typed content parts", ("messages",), ("images", "videos", "audios"),
                ("messages", "images", "videos", "audios", "system", "tools"), ("role", "content", "loss_weight", "tool_calls"),
                read_typed),
        _layout("qwen_vl", "<img> tags in conversations", ("conversations",), (),
                ("conversations", "system"), ("from", "value", "role", "content"), read_qwen_vl),
        _layout("swift_conversation", "conversation pairs", ("conversation",), ("images", "videos", "audios"),
                ("conversation", "images", "videos", "audios", "system"), ("human", "assistant"), read_swift_conversation),
        _layout("swift_query", "query/response/history", ("query",), ("images", "videos", "audios"),
                ("query", "response", "history", "images", "videos", "audios", "system"), (), read_swift_query),
        _layout("alpaca", "instruction/input/output", ("instruction", "output"), ("images", "videos", "audios"),
                ("instruction", "input", "output", "history", "images", "videos", "audios", "system"), (), read_alpaca),
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
        raise bad(
            where,
            f"{assumed} expects {' or '.join(repr(k) for k in layout.turns)}; the row has keys {sorted(row)}"
            + (f" (layout {found})" if found else ""),
        )
    for key in MEDIA_KEYS:
        if key in row and key not in layout.media:
            takes = f"takes media from {' and '.join(repr(k) for k in layout.media)}" if layout.media else "takes no media key"
            raise bad(where, f"the row has {key!r}, but {assumed} {takes}; its {key!r} would be dropped")
    if "objects" in row:
        raise bad(
            where,
            "the row has 'objects' (ms-swift grounding): qwenkit does not fill <ref-object>/<bbox> from it; write the "
            "references and boxes into the text in the family's coordinates (Qwen2.5-VL: absolute pixels of the resized "
            "image; Qwen3-VL and Qwen3.5: relative, 0-1000)",
        )
    if row.get("tools") and "tools" not in layout.keys:
        raise bad(where, f"the row has 'tools' (tool definitions), but {assumed} does not read them; the messages, typed "
                  "and sharegpt layouts do (docs/DATA.md, tool rows)")  # fmt: skip


def read(row: dict, where: Location, layout: str = "auto") -> Read:
    """``row`` read by ``layout`` (``auto``: :func:`detect`); raises :class:`~qwenkit.data.report.BadSample` naming the layout."""
    name = detect(row) if layout == "auto" else layout
    if name is None:
        raise bad(
            where,
            f"no layout has this row's keys {sorted(row)}; known: {', '.join(LAYOUTS)} (see docs/DATA.md)",
        )
    if layout != "auto" and name == "messages" and _typed(row):
        raise bad(where, "data.layout=messages, but message contents are lists of typed parts (layout typed)")
    spec = LAYOUTS[name]
    _fit(row, spec, layout != "auto", where)
    result = spec.read(row, where)
    if result.system is not None and not isinstance(result.system, str):
        raise bad(where, f"'system' must be a string, got {type(result.system).__name__}")
    for i, (_, text) in enumerate(result.messages):
        for tag in GROUNDING:
            if tag in text:
                raise bad(
                    where,
                    f"message {i} contains {tag} (an ms-swift grounding placeholder): qwenkit does not fill it; write "
                    "the reference and box into the text",
                )
        if name != "qwen_vl" and QWEN_VL_TAG.search(text):
            raise bad(
                where,
                f"message {i} contains a Qwen-VL <img>...</img> tag, but layout {name} takes images from "
                f"{result.media_from}; the tag would be trained as text (rows with <img> tags and no media key are "
                "read as layout qwen_vl)",
            )
    return result
