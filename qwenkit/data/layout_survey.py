"""What layouts a dataset's files hold, and the keys of their rows that no reader reads: the
lines ``qwenkit data check`` and notebook 01 print (the readers themselves: :mod:`qwenkit.data.layouts`).

A key no reader reads is not refused (an ``id``, a source's own metadata columns); it is listed,
so that what a row says only there is seen before training.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from qwenkit.data.layouts import LAYOUTS, detect
from qwenkit.data.reader import HFSource
from qwenkit.data.report import BadSample


def ignored_keys(row: dict, layout: str) -> set[str]:
    """Keys of ``row`` that ``layout`` does not read (``messages[].loss_weight`` for message keys)."""
    spec = LAYOUTS[layout]
    out = {k for k in row if k not in spec.keys}
    turns_key = next((k for k in spec.turns if k in row), None)
    turns = row.get(turns_key) if turns_key in ("messages", "conversations", "conversation", "texts") else None
    if isinstance(turns, list):
        for m in turns:
            if isinstance(m, dict):
                out.update(f"{turns_key}[].{k}" for k in m if k not in spec.message_keys)
                if layout == "typed" and isinstance(m.get("content"), list):
                    for part in m["content"]:
                        if isinstance(part, dict):
                            read = PART_KEYS | (FRAME_LIST_KEYS if isinstance(part.get("video"), list) else set())
                            out.update(f"content[].{k}" for k, v in part.items() if v is not None and k not in read)
    return out


# keys a typed part is read by: its type, text and source; a frame list's frame rate
PART_KEYS = {"type", "text", "value", "image", "image_url", "video", "url", "path", "index"}
FRAME_LIST_KEYS = {"fps", "sample_fps"}


@dataclass
class FileLayouts:
    """Layouts of one file's rows, and the keys they carry that qwenkit does not read."""

    name: str
    counts: Counter = field(default_factory=Counter)
    ignored: set[str] = field(default_factory=set)

    def lines(self) -> list[str]:
        parts = [
            f"{name} ({LAYOUTS[name].describe}), {n:,} row{'s' if n != 1 else ''}"
            if name in LAYOUTS else f"no layout, {n:,} row{'s' if n != 1 else ''}"
            for name, n in self.counts.most_common()
        ]  # fmt: skip
        out = [f"layout: {'; '.join(parts) or 'no rows'} in {self.name}"]
        if self.ignored:
            out.append(f"  keys not read (ignored): {', '.join(sorted(self.ignored))}")
        return out


def survey(sources, layout: str = "auto") -> list[FileLayouts]:
    """Per source: how many rows of each layout, and the keys no reader reads.

    A ``datasets`` source has one schema, so its first row stands for all of them."""
    out = []
    for source in sources:
        found = FileLayouts(source.name)
        if source.error is not None:
            out.append(found)
            continue
        n, one_schema = len(source), isinstance(source, HFSource)
        for i in range(min(n, 1) if one_schema else n):
            try:
                row = source.row(i)
            except BadSample:
                found.counts[None] += 1
                continue
            name = (detect(row) if layout == "auto" else layout) if isinstance(row, dict) else None
            if name is None:
                found.counts[None] += 1
                continue
            found.counts[name] += n if one_schema else 1
            found.ignored |= ignored_keys(row, name)
        out.append(found)
    return out


def describe(sources, layout: str = "auto") -> str:
    """:func:`survey` as the lines ``data check`` and notebook 01 print."""
    return "\n".join(line for found in survey(sources, layout) for line in found.lines())
