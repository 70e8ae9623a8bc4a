"""What every rollout engine hands back and every objective reads: the interface of the rollouts room.

:class:`Rollouts` is called by every rank with the prompts of its share (``rollouts(model, dataset,
indices, draw) -> [Completion]``), so any engine (:mod:`qwenkit.engine.rollouts.hf`,
:mod:`qwenkit.engine.rollouts.vllm`) stands in for another; everything after it (rewards, log-probs,
the loss) reads :class:`Completion` alone. A completion's seed (:func:`completion_seed`) and the tokens
it may never draw (:func:`media_tokens`) are the same on every engine; :func:`training_batch` makes the
training forward's micro-batch of ``prompt + completion`` rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from qwenkit.data.collator import SEQUENCE_KEYS, pack
from qwenkit.engine.generation.generate import reply_text
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX, shift_labels
from qwenkit.model.losses.logps import unpack


@dataclass
class Completion:
    index: int  # the dataset row of the prompt
    prompt: dict[str, torch.Tensor]  # the prompt's inputs, [1, S] per-token keys (CPU)
    tokens: list[int]  # the completion's ids, its end token included when it ended
    text: str  # decoded without the end token
    truncated: bool  # cut at max_new_tokens (no end token)
    reference: str  # the row's solution / answer column, or its last reply
    row: dict = field(default_factory=dict)  # the row's columns as read, a user's reward's keywords
    sampling_logps: list[float] | None = None  # the sampler's log-prob of each token (vLLM's, a grpo.rollout_dtype rollout's), None: the policy's own
    # an agentic trajectory (qwenkit.engine.rollouts.agentic): 1 on each sampled token, 0 on a tool's (None: all
    # sampled; sampling_logps then holds the sampled tokens' only), the tokens' own inputs after the prompt's (the
    # tools' pixel_values and image_grid_thw, the tokens' mm_token_type_ids [1, T]) and its messages and counts
    mask: list[int] | None = None
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    trajectory: dict | None = None

    @property
    def model_tokens(self) -> int:
        """The tokens the policy sampled (a trajectory's tool tokens left out)."""
        return len(self.tokens) if self.mask is None else sum(self.mask)


class Rollouts(Protocol):
    def __call__(self, model: nn.Module, dataset, indices: list[int], draw: int) -> list[Completion]:
        """``num_generations`` completions of each row of ``indices`` (this rank's share; grouped, in
        order), for rollout ``draw``. Every rank calls it together (it may be collective)."""


def media_tokens(processor) -> list[int]:
    """Token ids a completion must not hold: an image, video or audio placeholder (or a span's start or end)
    in a reply would make the training forward look for features it has not got ("image features and image
    tokens do not match", verl #3469, TRL #4488), so sampling never draws them."""
    names = ("image_token_id", "video_token_id", "vision_start_id", "vision_end_id")
    ids = {getattr(processor, n) for n in names if getattr(processor, n, None) is not None}
    return sorted(ids | set(getattr(processor, "audio_ids", ())))  # the Omni thinkers' audio span


def completion_seed(seed: int, draw: int, row: int, generation: int) -> int:
    """The sampling seed of completion ``generation`` of row ``row`` in rollout ``draw`` of a run seeded ``seed``."""
    key = f"{seed}/{draw}/{row}/{generation}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") % 2**63


def completion(tokenizer, new: list[int], end: int) -> tuple[list[int], str, bool]:
    """``(tokens, text, truncated)`` of one generated row: cut after its first end token (which is
    trained on, as TRL's EOS), decoded without it as evaluation decodes replies
    (:func:`qwenkit.engine.generation.generate.reply_text`: broken bytes as ``\\xNN``, valid text as the tokenizer's)."""
    ended = end in new
    new = new[: new.index(end) + 1] if ended else new
    return new, reply_text(tokenizer, new[:-1] if ended else new), not ended


def training_batch(completions: list[Completion], pad_token_id: int, packing: bool = False) -> dict[str, torch.Tensor]:
    """One right-padded micro-batch of ``prompt + completion`` rows; labels on the completion's sampled tokens only
    (a trajectory's tool tokens, ``mask`` 0, are ``IGNORE_INDEX`` as the prompt is).

    Per-token keys (``input_ids``, ``attention_mask``, ``mm_token_type_ids``, ``labels``) are
    padded to the longest row; pixels, grids and seconds per grid concatenated in row order (a row's
    prompt's, then its completion's ``media``), as the collator does. ``packing`` (``data.packing``): the rows
    as one packed row instead, no padding and no attention mask (:func:`qwenkit.data.collator.pack`); the
    model's log-probs of it come back as the padded batch's
    (:meth:`~qwenkit.model.families.chunked.ChunkLossMixin.token_logps`).
    """
    rows = []
    for c in completions:
        p = c.prompt
        n = p["input_ids"].shape[1]
        new = torch.tensor([c.tokens], dtype=p["input_ids"].dtype)
        learnt = new if c.mask is None else new.masked_fill(torch.tensor([c.mask]) == 0, IGNORE_INDEX)
        row = {
            "input_ids": torch.cat([p["input_ids"], new], dim=1),
            "attention_mask": torch.ones(1, n + new.shape[1], dtype=torch.long),
            "labels": torch.cat([torch.full((1, n), IGNORE_INDEX), learnt], dim=1),
        }
        if "mm_token_type_ids" in p:
            own = c.media.get("mm_token_type_ids", torch.zeros_like(new))
            row["mm_token_type_ids"] = torch.cat([p["mm_token_type_ids"], own.to(p["mm_token_type_ids"].dtype)], dim=1)
        row.update({k: v for k, v in p.items() if k not in row})
        for key, value in c.media.items():
            if key != "mm_token_type_ids":
                row[key] = torch.cat([row[key], value]) if key in row else value
        rows.append(row)
    width = max(r["input_ids"].shape[1] for r in rows)
    pads = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}
    batch = pack([{k: r[k][0] for k in SEQUENCE_KEYS if k in r} for r in rows]) if packing else {}
    for key, value in pads.items():
        if key not in rows[0] or packing:
            continue
        out = torch.full((len(rows), width), value, dtype=rows[0][key].dtype)  # [B, S]
        for b, r in enumerate(rows):
            out[b, : r[key].shape[1]] = r[key][0]
        batch[key] = out
    for key in sorted({k for r in rows for k in r if k not in pads}):
        batch[key] = torch.cat([r[key] for r in rows if key in r])
    return batch


def completion_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, S]`` where :func:`training_batch`'s ``batch`` has completion tokens (a shifted label), in the padded
    layout the model's per-token log-probs come in, packed or not."""
    mask = shift_labels(batch["labels"]) != IGNORE_INDEX
    return unpack(mask, batch["packed_seq_lens"]) if "packed_seq_lens" in batch else mask


__all__ = ["Completion", "Rollouts", "completion", "completion_mask", "completion_seed", "media_tokens", "training_batch"]
