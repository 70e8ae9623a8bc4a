"""Where the rows of a JSON or JSONL file lie, found in one pass over its bytes (16 MiB at a time): a row is
then read with ``pread`` and parsed when asked for (:class:`qwenkit.data.reader.JsonSource`). A JSONL line
that does not parse is one bad row; a JSON array that does not parse, or is not UTF-8, is one unreadable
file named by line and column, with no rows."""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from qwenkit.data.report import BadSample, Location

BLOCK = 1 << 24  # bytes read at a time while finding rows: the pass's memory, whatever the file's size
BOM = codecs.BOM_UTF8
WHITESPACE = b" \t\n\r\x0b\x0c"  # what bytes.strip() strips: a JSONL line of only these is no row
_JSON_WS = re.compile(r"[ \t\n\r]*")


@dataclass
class RowSpans:
    """Where the rows of one JSON or JSONL file lie: row ``i`` is bytes ``start[i]:start[i]+size[i]``.

    ``start [n]`` int64, ``size [n]`` int32, ``line [n]`` int32 (a JSONL row's line; 0 for the
    rows of a JSON array, which are reported by row). ``error``: the file is unreadable as a
    whole (a JSON array that does not parse, or is not UTF-8); it then has no rows.
    """

    start: np.ndarray
    size: np.ndarray
    line: np.ndarray
    error: BadSample | None = None

    def __len__(self) -> int:
        return len(self.start)

    @classmethod
    def empty(cls, error: BadSample | None = None) -> RowSpans:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32), error)

    @classmethod
    def find(cls, path: Path, bar: tqdm | None = None, most: int | None = None) -> RowSpans:
        """One pass over ``path`` (``bar`` counts its bytes). ``most``: stop once that many rows are
        found (a JSONL file: at the end of the block that holds them): the spans of the file's first
        rows, for a count that needs no more (the launcher's, :func:`qwenkit.data.load.rows_at_most`)."""
        with open(path, "rb") as f:
            return _jsonl_spans(f, bar, most) if path.suffix == ".jsonl" else _json_spans(f, str(path), bar, most)


def _jsonl_spans(f, bar: tqdm | None, most: int | None = None) -> RowSpans:
    """Lines that are not blank (``bytes.strip()`` leaves something), numbered from 1."""
    starts, sizes, lines = [], [], []
    carry, base, lineno = b"", 0, 0  # carry: the unfinished last line, from file offset base
    while True:
        block = f.read(BLOCK)
        if bar is not None:
            bar.update(len(block))
        buf = carry + block if carry else block
        if not buf:
            break
        ends = np.flatnonzero(np.frombuffer(buf, np.uint8) == 10)  # [lines] the newlines
        if not block:  # end of file: the last line has no newline
            ends = np.append(ends, len(buf))
        begins = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
        size = ends - begins
        # blank lines are rare: only lines that are empty or start with whitespace are looked at
        head = np.frombuffer(buf, np.uint8)[np.minimum(begins, len(buf) - 1)]
        maybe = np.flatnonzero((size == 0) | np.isin(head, np.frombuffer(WHITESPACE, np.uint8)))
        blank = [k for k in maybe.tolist() if not buf[begins[k] : ends[k]].strip()]
        keep = np.ones(len(ends), bool)
        keep[blank] = False
        starts.append(base + begins[keep])
        sizes.append(size[keep].astype(np.int32))
        lines.append((lineno + 1 + np.flatnonzero(keep)).astype(np.int32))
        lineno += len(ends)
        if not block or (most is not None and sum(map(len, starts)) >= most):
            break
        cut = int(ends[-1]) + 1 if len(ends) else 0
        carry, base = buf[cut:], base + cut
    if not starts:
        return RowSpans.empty()
    return RowSpans(np.concatenate(starts), np.concatenate(sizes), np.concatenate(lines))


def _json_spans(f, name: str, bar: tqdm | None, most: int | None = None) -> RowSpans:
    """The elements of a top-level JSON array, found by parsing one element at a time.

    The bytes are decoded as Latin-1 (one character per byte, so positions are byte offsets)
    for the parse, which only finds where each element ends; each block is also checked to be
    UTF-8, as the rows are decoded when they are read. A malformed element is the whole file's
    error, named by line and column as ``json.loads`` names it.
    """
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    text, base, eof = "", 0, False  # text: the file's bytes from offset base, one char per byte
    newlines, last_newline = 0, -1  # in the bytes before base: count, and offset of the last one
    starts, sizes = [], []

    def more() -> None:
        nonlocal text, eof
        block = f.read(BLOCK)
        if bar is not None:
            bar.update(len(block))
        eof = not block
        pending = len(utf8.getstate()[0])  # the last block's unfinished character, decoded with this one
        try:
            utf8.decode(block, final=eof)  # only the check; the text is dropped
        except UnicodeDecodeError as e:
            raise _NotUtf8(f"{e.reason} at byte {base + len(text) - pending + e.start}") from None
        text = text + block.decode("latin-1") if text else block.decode("latin-1")

    def bad(msg: str, pos: int) -> RowSpans:
        k = text.rfind("\n", 0, pos)
        line = newlines + text.count("\n", 0, pos) + 1
        column = pos - k if k >= 0 else base + pos - last_newline
        return RowSpans.empty(BadSample(Location(name, line=line), "malformed_json", f"column {column}: {msg}"))

    def ws(pos: int) -> int:
        """Past the whitespace at ``pos``, reading on while the text ends in whitespace."""
        while True:
            pos = _JSON_WS.match(text, pos).end()
            if pos < len(text) or eof:
                return pos
            more()

    try:
        more()
        if text.startswith(BOM.decode("latin-1")):  # json.loads of 'utf-8-sig' text: columns after it
            text, base, last_newline = text[len(BOM) :], len(BOM), len(BOM) - 1
        pos = ws(0)
        if text[pos : pos + 1] != "[":
            return _not_an_array(f, name)
        pos = ws(pos + 1)
        if text[pos : pos + 1] == "]":
            pos += 1
        else:
            while True:
                try:
                    _, end = decoder.raw_decode(text, pos)
                    complete = end < len(text) or eof  # a number at the end of the text may go on
                except json.JSONDecodeError as e:
                    if eof:
                        return bad(e.msg, e.pos)
                    complete = False
                if not complete:
                    more()
                    continue
                starts.append(base + pos)
                sizes.append(end - pos)
                if most is not None and len(starts) >= most:  # enough for the count: the rest is not read
                    return RowSpans(np.asarray(starts, np.int64), np.asarray(sizes, np.int32), np.zeros(len(starts), np.int32))
                pos = ws(end)
                sep = text[pos : pos + 1]
                if sep == "]":
                    pos += 1
                    break
                if sep != ",":
                    return bad("Expecting ',' delimiter", pos)
                pos = ws(pos + 1)
                if pos > BLOCK:  # drop what has been read: the pass holds about two blocks
                    k = text.rfind("\n", 0, pos)
                    if k >= 0:
                        newlines, last_newline = newlines + text.count("\n", 0, pos), base + k
                    text, base, pos = text[pos:], base + pos, 0
        pos = ws(pos)
        if pos < len(text):
            return bad("Extra data", pos)
    except _NotUtf8 as e:
        return RowSpans.empty(BadSample(Location(name), "malformed_json", f"not UTF-8 text ({e})"))
    return RowSpans(np.asarray(starts, np.int64), np.asarray(sizes, np.int32), np.zeros(len(starts), np.int32))


class _NotUtf8(Exception):
    pass


def _not_an_array(f, name: str) -> RowSpans:
    """A file that does not start with ``[``: parsed whole, only to say what it is instead."""
    f.seek(0)
    try:
        data = json.loads(f.read().decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        return RowSpans.empty(
            BadSample(Location(name), "malformed_json", f"not UTF-8 text ({e.reason} at byte {e.start})")
        )
    except json.JSONDecodeError as e:
        return RowSpans.empty(BadSample(Location(name, line=e.lineno), "malformed_json", f"column {e.colno}: {e.msg}"))
    return RowSpans.empty(
        BadSample(Location(name), "bad_format", f"top level must be a JSON array of rows, got {type(data).__name__}")
    )
