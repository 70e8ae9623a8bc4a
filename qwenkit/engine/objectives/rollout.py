"""GRPO's rollouts: ``grpo.num_generations`` completions of each prompt, sampled from the current policy.

One interface, :class:`Rollouts`: ``rollouts(model, dataset, indices, draw) -> [Completion]``, so a
faster engine (vLLM on CUDA) can stand in for :class:`HfRollouts` later; everything after it
(rewards, log-probs, the loss) reads :class:`Completion` alone.

:class:`HfRollouts` generates through the kit's generation path (:func:`qwenkit.engine.generation.generate.lockstep`):
the **sharded training model itself**, every rank stepping together (HF's ``synced_gpus``; the
vision tower inside the prefill, idle calls on a rank without images), so the policy that samples
is exactly the one being trained, no copy of the weights. Prompts come from
:meth:`qwenkit.data.dataset.EncodedDataset.prompt` (every turn before the row's last reply, with its
images and videos, or the whole conversation of a prompt-only row); the reference is the row's
``solution`` / ``answer`` column where it has one, else that reply
(:mod:`qwenkit.data.conversation`).

**Reproducible.** Each prompt's group is one ``generate`` call (the prompt repeated
``num_generations`` times, left-padding nothing; image and video tokens never drawn,
:func:`media_tokens`), sampled from a generator seeded by
``(train.seed, draw, row)`` (:func:`group_seed`): the completions of a row depend neither on the
rank that draws it nor on the other rows, so 2 ranks sample what 1 process samples, and a resumed
run what the uninterrupted one did. The training RNG is left where it was.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from qwenkit.engine.generation.generate import Sampling, generation_config, left_pad, lockstep, reply_text
from qwenkit.model.loss import IGNORE_INDEX


@dataclass
class Completion:
    index: int  # the dataset row of the prompt
    prompt: dict[str, torch.Tensor]  # the prompt's inputs, [1, S] per-token keys (CPU)
    tokens: list[int]  # the completion's ids, its end token included when it ended
    text: str  # decoded without the end token
    truncated: bool  # cut at max_new_tokens (no end token)
    reference: str  # the row's solution / answer column, or its last reply
    row: dict = field(default_factory=dict)  # the row's columns as read, a user's reward's keywords
    sampling_logps: list[float] | None = None  # the sampler's log-prob of each token (vLLM's), None: the policy's own


class Rollouts(Protocol):
    def __call__(self, model: nn.Module, dataset, indices: list[int], draw: int) -> list[Completion]:
        """``num_generations`` completions of each row of ``indices`` (grouped, in order), for rollout ``draw``."""


def media_tokens(processor) -> list[int]:
    """Token ids a completion must not hold: an image or video placeholder in a reply would make the
    training forward look for features it has not got ("image features and image tokens do not match",
    verl #3469, TRL #4488), so sampling never draws them."""
    names = ("image_token_id", "video_token_id", "vision_start_id", "vision_end_id")
    return sorted({getattr(processor, n) for n in names if getattr(processor, n, None) is not None})


def group_seed(seed: int, draw: int, row: int) -> int:
    """The sampling seed of row ``row``'s group in rollout ``draw`` of a run seeded ``seed``."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{draw}/{row}".encode()).digest()[:8], "little") % 2**63


class HfRollouts:
    """Rollouts through HF ``generate`` on the sharded policy (module docstring)."""

    def __init__(self, sampling: Sampling, num_generations: int):
        if sampling.temperature <= 0:
            raise ValueError("rollouts sample: temperature must be > 0")
        self.sampling, self.num_generations = sampling, num_generations

    @torch.no_grad()
    def __call__(self, model: nn.Module, dataset, indices: list[int], draw: int) -> list[Completion]:
        tok = dataset.processor.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")
        pad = dataset.processor.pad_token_id
        config = generation_config(self.sampling, end, pad)
        config.suppress_tokens = media_tokens(dataset.processor)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        out = []
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.random.fork_rng(devices=[device] if device.type != "cpu" else []))
                step = stack.enter_context(lockstep(model))
                for i in indices:
                    prompt, conv = dataset.prompt(i)
                    columns = dataset.columns(i)
                    inputs = {k: v.to(device) for k, v in left_pad([prompt] * self.num_generations, pad).items()}
                    torch.manual_seed(group_seed(self.sampling.seed, draw, i))
                    tokens = step(inputs, config)[:, inputs["input_ids"].shape[1] :].tolist()  # [G, new]
                    for new in tokens:
                        new, text, truncated = completion(tok, new, end)
                        out.append(Completion(i, prompt, new, text, truncated, conv.reference, columns))
        finally:
            model.train(was_training)
        return out


def completion(tokenizer, new: list[int], end: int) -> tuple[list[int], str, bool]:
    """``(tokens, text, truncated)`` of one generated row: cut after its first end token (which is
    trained on, as TRL's EOS), decoded without it as evaluation decodes replies
    (:func:`qwenkit.engine.generation.generate.reply_text`: broken bytes as ``\\xNN``, valid text as the tokenizer's)."""
    ended = end in new
    new = new[: new.index(end) + 1] if ended else new
    return new, reply_text(tokenizer, new[:-1] if ended else new), not ended


def training_batch(completions: list[Completion], pad_token_id: int) -> dict[str, torch.Tensor]:
    """One right-padded micro-batch of ``prompt + completion`` rows; labels on the completion only.

    Per-token keys (``input_ids``, ``attention_mask``, ``mm_token_type_ids``, ``labels``) are
    padded to the longest row; pixels, grids and seconds per grid concatenated in row order, as
    the collator does.
    """
    rows = []
    for c in completions:
        p = c.prompt
        n = p["input_ids"].shape[1]
        new = torch.tensor([c.tokens], dtype=p["input_ids"].dtype)
        row = {
            "input_ids": torch.cat([p["input_ids"], new], dim=1),
            "attention_mask": torch.ones(1, n + new.shape[1], dtype=torch.long),
            "labels": torch.cat([torch.full((1, n), IGNORE_INDEX), new], dim=1),
        }
        if "mm_token_type_ids" in p:
            row["mm_token_type_ids"] = torch.cat([p["mm_token_type_ids"], torch.zeros_like(new)], dim=1).to(
                p["mm_token_type_ids"].dtype)  # fmt: skip
        row.update({k: v for k, v in p.items() if k not in row})
        rows.append(row)
    width = max(r["input_ids"].shape[1] for r in rows)
    pads = {"input_ids": pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}
    batch = {}
    for key, value in pads.items():
        if key not in rows[0]:
            continue
        out = torch.full((len(rows), width), value, dtype=rows[0][key].dtype)  # [B, S]
        for b, r in enumerate(rows):
            out[b, : r[key].shape[1]] = r[key][0]
        batch[key] = out
    for key in sorted({k for r in rows for k in r if k not in pads}):
        batch[key] = torch.cat([r[key] for r in rows if key in r])
    return batch


__all__ = ["Completion", "HfRollouts", "Rollouts", "completion", "group_seed", "media_tokens", "training_batch"]
