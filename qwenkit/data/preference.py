"""Preference pairs (``train.objective: dpo``): the layouts people bring, read as two SFT rows each.

A preference row holds one prompt and two replies. Each layout below is read into two plain
conversations that share every turn before the last (the prompt) and differ in the last
assistant reply; each then goes through the SFT pipeline unchanged (layout checks, template,
scan, index and its cache, bad-sample policy), as rows ``2k`` (chosen) and ``2k + 1``
(rejected) of a :class:`PreferenceSource`:

==================  ==============================================================================
layout              row
==================  ==============================================================================
TRL                 ``prompt`` / ``chosen`` / ``rejected``: strings (plain) or lists of messages
                    (conversational; contents may be typed parts, ``{"type": "image"}`` taking
                    the next of ``images``), ``images`` optional. A plain prompt without
                    ``<image>`` placeholders gets them in front (as TRL's processor does)
LLaMA-Factory       ``conversations`` (sharegpt, ending in a user turn) + ``chosen`` / ``rejected``
                    (each one ``{"from": "gpt", "value": ...}``), ``images``/``videos``/``audios``
ms-swift            ``messages`` ending in the chosen assistant reply + ``rejected_response``
                    (a string), ``images``/``videos``/``audios``; ``rejected_images`` where the
                    rejected reply sees other images
==================  ==============================================================================

A row that fits none, or whose parts are malformed, or whose two sides are the same
(``same_replies``: nothing to prefer), is one bad pair naming its file, row and reason; a pair is
used only when both of its sides pass the scan, and bad pairs are counted as pairs
(:func:`pair_report`: ``data.max_bad_fraction`` and ``data check`` count pairs, not sides). :class:`PairDataset` hands
out ``(chosen, rejected)`` samples: the images, videos and audios are loaded and processed once per
pair when both sides see the same ones, and a pair is one index of the sampler, so it is never
split across micro-batches or ranks. :class:`PairCollator` makes one micro-batch of the chosen
rows followed by the rejected rows (one forward for both).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qwenkit.data.cache import cache_dir
from qwenkit.data.collator import Collator
from qwenkit.data.dataset import EncodedDataset
from qwenkit.data.layout_readers import IMAGE_PLACEHOLDER
from qwenkit.data.reader import HFSource
from qwenkit.data.report import BadSample, BadSampleReport, Location
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX

log = logging.getLogger(__name__)

PAIR_LAYOUTS = ("trl", "llamafactory", "swift")
MEDIA = ("images", "videos", "audios")  # the media columns both sides of a pair share (rejected_images aside)
CHOSEN, REJECTED = 0, 1  # the side of a pair: row 2k + side of a PreferenceSource


def _bad(where: Location, detail: str) -> BadSample:
    return BadSample(where, "bad_format", f"preference row: {detail}")


def pair_layout(row: Any) -> str | None:
    """Which preference layout ``row`` is written in, or None."""
    if not isinstance(row, dict):
        return None
    if "rejected_response" in row:
        return "swift"
    if "chosen" in row and "rejected" in row:
        if "conversations" in row:
            return "llamafactory"
        if "prompt" in row:
            return "trl"
    return None


def split_pair(row: Any, where: Location) -> tuple[dict, dict]:
    """``(chosen row, rejected row)``: two SFT rows (layouts ``messages``/``typed``/``sharegpt``)."""
    layout = pair_layout(row)
    if layout is None:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise _bad(
            where,
            f"no preference layout has the keys {keys}: expected TRL prompt/chosen/rejected, LLaMA-Factory "
            "conversations/chosen/rejected or ms-swift messages/rejected_response (see docs/DATA.md)",
        )
    common = {k: row[k] for k in ("id", "system", "tools") if k in row}  # what both sides share
    chosen, rejected = {"trl": _trl, "llamafactory": _llamafactory, "swift": _swift}[layout](row, where, common)
    if chosen == rejected:  # the same reply (and images): DPO's loss is constant on it, nothing is learned
        raise BadSample(where, "same_replies", "preference row: the chosen and rejected replies are the same")
    return chosen, rejected


def pair_report(index) -> BadSampleReport:
    """The scan's tally in pairs (``index``: a :class:`~qwenkit.data.index.SampleIndex` of a
    :class:`PreferenceSource`, two samples per row): a pair is bad once, however many of its sides
    are, under its first side's reason; a second side's other problem joins the pair's one line."""
    report = BadSampleReport(total=index.total // 2, unit="pairs")
    lines: dict[tuple, list[str]] = {}
    for i, rec in enumerate(index.bad):
        key = (rec.source, rec.row) if rec.row is not None else ("file", i)  # a row's two sides share its location
        bad = rec.error()
        if key not in lines:
            lines[key] = [str(bad)]
            report.skipped += 1
            report.by_reason[bad.reason] = report.by_reason.get(bad.reason, 0) + 1
        elif f"{bad.reason}: {bad.detail}" not in lines[key][0]:
            lines[key].append(f"{bad.reason}: {bad.detail}")
    report.messages = ["; and ".join(parts) for parts in lines.values()]
    return report


def _trl(row: dict, where: Location, common: dict) -> tuple[dict, dict]:
    prompt, media = row["prompt"], {k: row[k] for k in MEDIA if row.get(k) is not None}
    if isinstance(prompt, str):  # plain: one user turn, each reply a string
        replies = []
        for side in ("chosen", "rejected"):
            if not isinstance(row[side], str):
                raise _bad(where, f"a plain (string) prompt takes string replies; '{side}' is {type(row[side]).__name__}")
            replies.append(row[side])
        images = media.get("images") or []
        n_images = 1 if isinstance(images, (str, dict)) else len(images)
        text = prompt if IMAGE_PLACEHOLDER in prompt else IMAGE_PLACEHOLDER * n_images + prompt
        return tuple(
            {**common, **media, "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": r}]}
            for r in replies
        )
    if not isinstance(prompt, list):
        raise _bad(where, f"'prompt' must be a string or a list of messages, got {type(prompt).__name__}")
    sides = []
    for side in ("chosen", "rejected"):
        reply = row[side]
        if not (isinstance(reply, list) and reply and all(isinstance(m, dict) for m in reply)):
            raise _bad(where, f"a conversational prompt takes '{side}' as a list of messages, got {reply!r:.60}")
        if reply[-1].get("role") != "assistant":
            raise _bad(where, f"'{side}' must end with an assistant message, got role {reply[-1].get('role')!r}")
        sides.append({**common, **media, "messages": list(prompt) + list(reply)})
    return sides[0], sides[1]


def _llamafactory(row: dict, where: Location, common: dict) -> tuple[dict, dict]:
    turns, media = row["conversations"], {k: row[k] for k in MEDIA if row.get(k) is not None}
    if not isinstance(turns, list) or not turns:
        raise _bad(where, f"'conversations' must be a non-empty list, got {turns!r:.60}")
    sides = []
    for side in ("chosen", "rejected"):
        reply = row[side]
        if isinstance(reply, str):
            reply = {"from": "gpt", "value": reply}
        if not isinstance(reply, dict) or reply.get("from", reply.get("role")) not in ("gpt", "assistant"):
            raise _bad(where, f"'{side}' must be one reply {{\"from\": \"gpt\", \"value\": ...}}, got {row[side]!r:.60}")
        sides.append({**common, **media, "conversations": list(turns) + [reply]})
    return sides[0], sides[1]


def _swift(row: dict, where: Location, common: dict) -> tuple[dict, dict]:
    messages, rejected = row.get("messages"), row["rejected_response"]
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        raise _bad(where, "ms-swift 'rejected_response' needs 'messages' ending with the chosen assistant reply")
    if messages[-1].get("role") != "assistant":
        raise _bad(where, f"the last message must be the chosen assistant reply, got role {messages[-1].get('role')!r}")
    if not isinstance(rejected, str):
        raise _bad(where, f"'rejected_response' must be a string, got {type(rejected).__name__}")
    media = {k: row[k] for k in MEDIA if row.get(k) is not None}
    chosen = {**common, **media, "messages": list(messages)}
    other = dict(media)
    if row.get("rejected_images") is not None:
        other["images"] = row["rejected_images"]
    last = {**messages[-1], "content": rejected}
    return chosen, {**common, **other, "messages": list(messages[:-1]) + [last]}


class PreferenceSource:
    """A source of preference rows seen as twice as many SFT rows: ``2k`` chosen, ``2k + 1`` rejected of row ``k``."""

    def __init__(self, inner):
        self.inner = inner
        self.name, self.base_dir = inner.name, inner.base_dir
        for attr in ("path", "fingerprint"):  # what the index cache keys a source by
            if hasattr(inner, attr):
                setattr(self, attr, getattr(inner, attr))

    def __len__(self) -> int:
        return 2 * len(self.inner)

    def parse(self) -> None:
        self.inner.parse()

    @property
    def error(self):
        return self.inner.error

    def location(self, i: int) -> Location:
        return self.inner.location(i // 2)  # errors name the row of the file

    def row(self, i: int) -> dict:
        return split_pair(self.inner.row(i // 2), self.location(i))[i % 2]


class _HFPreferenceSource(PreferenceSource, HFSource):
    """An HF dataset's pairs: still an ``HFSource`` to the index cache (keyed by datasets' fingerprint)."""


def preference_sources(sources: list) -> list[PreferenceSource]:
    return [(_HFPreferenceSource if isinstance(s, HFSource) else PreferenceSource)(s) for s in sources]


def pair_indices(dataset: EncodedDataset) -> np.ndarray:
    """``[P, 2]`` dataset indices (chosen, rejected) of the pairs whose both sides passed the scan."""
    return index_pairs(dataset.index)


def index_pairs(index) -> np.ndarray:
    """:func:`pair_indices` of a prepared index (:class:`~qwenkit.data.index.SampleIndex`) alone."""
    key = index.source.astype(np.int64) * (2**40) + index.row.astype(np.int64)  # [N] (source, row) of each sample
    position = {int(k): i for i, k in enumerate(key)}
    pairs = [(i, position[int(k) + 1]) for i, k in enumerate(key) if k % 2 == CHOSEN and int(k) + 1 in position]
    return np.array(pairs, dtype=np.int64).reshape(-1, 2)


class PairDataset:
    """``dataset[p]`` is ``(chosen sample, rejected sample)`` of pair ``p``; see the module docstring.

    ``data.on_bad_sample: skip``: a pair with a side that fails to load is replaced by the next
    pair (both sides together), as :class:`EncodedDataset` replaces a sample.
    """

    def __init__(self, samples: EncodedDataset, pairs: np.ndarray | None = None):
        self.samples = samples
        self.pairs = pair_indices(samples) if pairs is None else pairs

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def sources(self):
        return self.samples.sources

    @property
    def has_videos(self) -> bool:
        return self.samples.has_videos

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per pair: chosen + rejected, ``[P]``."""
        return self.samples.lengths[self.pairs].sum(1)

    def __getitem__(self, p: int) -> tuple[dict, dict]:
        n = len(self)
        for k in range(n):
            try:
                chosen, rejected = self.encode((p + k) % n)
            except BadSample as bad:
                if self.samples.data.on_bad_sample == "error":
                    raise
                log.warning("skipping the preference pair of a bad sample met while loading: %s", bad)
                continue
            if k:
                chosen["num_bad"] = torch.tensor(k)
            chosen["pair_index"] = torch.tensor((p + k) % n)  # which pair it is (dpo.precompute_ref's tables)
            return chosen, rejected
        raise ValueError(f"every one of the {n} pairs failed to load; see the warnings above")

    def encode(self, p: int) -> tuple[dict, dict]:
        c, r = (int(i) for i in self.pairs[p])
        chosen = self.samples.encode(c)
        same_media = self._media_refs(c) == self._media_refs(r)
        media = {k: v for k, v in chosen.items() if k not in ("input_ids", "labels", "mm_token_type_ids")}
        rejected = self.samples.encode(r, media=media if same_media else None)  # pixels processed once per pair
        return chosen, rejected

    def _media_refs(self, i: int):
        conv = self.samples.conversation(i)
        return conv.images, conv.videos, conv.audios


class PairCollator:
    """``[(chosen, rejected)] * P`` → one micro-batch of ``2P`` rows: the chosen ones, then the rejected.

    Adds ``num_pairs`` (``P``) and ``num_chosen_items`` (the chosen replies' label tokens), the
    global normalisers of the preference loss and its SFT term, and ``pair_index [P]``. ``packing``
    (``data.packing``): the ``2P`` rows packed into one, in the same order (the model's per-sequence
    log-probs of a packed row are its samples', :meth:`~qwenkit.model.families.chunked.ChunkLossMixin.sequence_logps`).
    """

    def __init__(self, processor, packing: bool = False):
        self.collator = Collator(processor, packing)

    def __call__(self, pairs: list[tuple[dict, dict]]) -> dict[str, torch.Tensor]:
        index = [c.pop("pair_index") for c, _ in pairs if "pair_index" in c]
        batch = self.collator([c for c, _ in pairs] + [r for _, r in pairs])
        n = len(pairs)
        if index:
            batch["pair_index"] = torch.stack(index)  # [P]
        batch["num_pairs"] = torch.tensor(n)
        if "packed_seq_lens" in batch:  # the chosen rows' stretch of the packed row
            chosen = batch["labels"][:, 1 : int(batch["packed_seq_lens"][:n].sum())]
        else:
            chosen = batch["labels"][:n, 1:]
        batch["num_chosen_items"] = (chosen != IGNORE_INDEX).sum()
        return batch


def preference_data(data):
    """``data`` with its index cache in a ``preference/`` sub-folder: a file read as pairs holds twice its rows."""
    return dataclasses.replace(data, cache_dir=str(Path(cache_dir(data)) / "preference"))
