"""Generation on held-out rows, sharded over the ranks and batched: did the fine-tune help?

:func:`generate_rows` runs HF ``generate`` on each row's prompt (every turn before the row's
last assistant reply) in batches of :attr:`Sampling.batch_size` prompts, left-padded, with the KV
cache, greedy unless :attr:`Sampling.temperature` > 0; each reply ends at ``<|im_end|>`` or after
``max_new_tokens``. :func:`gather_rows` brings every rank's rows to rank 0 in row order, where
:func:`write_jsonl` keeps prompt, image paths, reference, reply (text and token ids) and every
metric's score (:mod:`qwenkit.engine.generation.answers`) of every row.

**Batched equals one row at a time.** A left-padded row ends at the same column as every other,
its pad positions masked out of attention; HF's Qwen2.5-VL ``get_rope_index`` computes each
row's mRoPE positions from its unmasked tokens alone (``attention_mask`` selects them) and keeps
the per-row offset (``rope_deltas``) for the decoding steps, so a row's greedy tokens do not
depend on its batch (fp32: tests check it token for token, with images, a video, text-only rows
and prompts of different lengths in one batch). Nothing here is Qwen2.5-specific: any model
whose ``generate`` takes the dataset's prompt keys works, ``input_ids`` and the per-token keys of
:data:`PAD` left-padded, every other key (pixels, grids) concatenated in row order.

**Every rank generates its share** (rows ``r, r + W, ...`` of the requested ones, longest samples
first so a batch wastes little padding), from a full copy of the weights or the sharded model in
lockstep (``train.eval_generation``; :mod:`qwenkit.engine.generation.placement`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import GenerationConfig

from qwenkit.data.collator import join_media
from qwenkit.engine.generation.placement import lockstep, model_kwargs
from qwenkit.engine.generation.sampling import Sampling
from qwenkit.model.families.positions import thinker_keywords
from qwenkit.records import read_jsonl as read_jsonl  # the one JSONL reader; eval/step-*.jsonl are read by it

log = logging.getLogger(__name__)

# per-token prompt keys other than input_ids (padded with the pad token id), and their pad values
PAD = {"attention_mask": 0, "mm_token_type_ids": 0}


@dataclass
class Generation:
    index: int  # row of the eval dataset
    prompt: str  # the turns before the reply, one "role: text" line each
    images: list[str]  # image paths (or labels of embedded images)
    reference: str
    generated: str
    tokens: list[int] = field(default_factory=list)  # the reply's token ids, without the end token
    scores: dict[str, float] = field(default_factory=dict)  # metric name -> this row's score

    def to_json(self) -> dict:
        return {
            "index": self.index, "prompt": self.prompt, "images": self.images, "reference": self.reference,
            "generated": self.generated, "tokens": self.tokens, "scores": self.scores,
        }  # fmt: skip


def mean_scores(rows: list[Generation]) -> dict[str, float]:
    """Each metric's mean over ``rows`` (every row carries the same metrics)."""
    names = list(rows[0].scores) if rows else []
    return {name: sum(r.scores[name] for r in rows) / len(rows) for name in names}


def left_pad(prompts: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """One batch of ``[1, S_i]`` prompts: per-token keys left-padded to ``[B, max S]``, every
    other key (pixels, grids, seconds per grid) concatenated along dim 0 in row order."""
    width = max(p["input_ids"].shape[1] for p in prompts)
    pads = {"input_ids": pad_token_id, **PAD}
    batch: dict[str, torch.Tensor] = {}
    for key in prompts[0]:
        if key in pads:
            out = torch.full((len(prompts), width), pads[key], dtype=prompts[0][key].dtype)  # [B, S]
            for b, p in enumerate(prompts):
                out[b, width - p[key].shape[1] :] = p[key][0]
            batch[key] = out
    for key in sorted({k for p in prompts for k in p if k not in pads}):
        batch[key] = join_media(key, [p[key] for p in prompts if key in p])
    return batch


def reply_text(tokenizer, ids: list[int]) -> str:
    """The text of token ``ids`` (special tokens left out), with bytes that are not UTF-8 as escapes.

    An untrained (or sampling) model's tokens can end or break a multi-byte character; the
    tokenizer decodes those bytes to U+FFFD each, which reads as "\ufffd" on every row alike.
    With a byte-level vocabulary (Qwen's BPE) the token strings map back to their bytes, which are
    decoded with ``backslashreplace`` instead: ``b"\\xe4"`` shows as ``\\xe4``. Valid text decodes
    exactly as the tokenizer decodes it.
    """
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in text:
        return text
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    # ids past the tokenizer's vocabulary (a model's embedding can be larger) have no piece; decode drops them too
    pieces = [p for p in tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=True) if p is not None]
    if not all(c in byte_of for piece in pieces for c in piece):
        return text  # not a byte-level vocabulary: the tokenizer's own decoding
    return bytes(byte_of[c] for piece in pieces for c in piece).decode("utf-8", errors="backslashreplace")


def generation_config(sampling: Sampling, eos_token_id: int, pad_token_id: int) -> GenerationConfig:
    if sampling.temperature > 0:
        how = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    else:
        how = dict(do_sample=False)
    return GenerationConfig(max_new_tokens=sampling.max_new_tokens, num_beams=1, eos_token_id=eos_token_id,
                            pad_token_id=pad_token_id, **how)  # fmt: skip


@torch.no_grad()
def generate_rows(
    model: nn.Module, dataset, indices: list[int], sampling: Sampling, rank: int = 0, lockstep_calls: int | None = None,
) -> list[Generation]:  # fmt: skip
    """Replies of ``model`` to the prompts of ``dataset[indices]``, in the order of ``indices``.

    ``dataset``: ``prompt(i) -> (inputs, conversation)``, ``image_refs(i, conversation)``,
    ``lengths`` and ``processor`` (:class:`qwenkit.data.dataset.EncodedDataset`). Prompts are
    batched longest first (by the index's sample length, reply included: sorting loads no media);
    ``batch_size=1`` is one row per ``generate`` call, unpadded.
    Sampling (temperature > 0) draws from its own generator state seeded by ``seed + rank``:
    the training RNG is left where it was.
    ``lockstep_calls``: ``model`` is sharded and every rank makes this many ``generate`` calls
    in lockstep (collective, see the module docstring); None: this rank generates alone.
    """
    tok = dataset.processor.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    pad = dataset.processor.pad_token_id
    config = generation_config(sampling, im_end, pad)
    device = next(model.parameters()).device
    order = sorted(indices, key=lambda i: -int(dataset.lengths[i]))  # stable: ties keep their order
    batches = [order[start : start + sampling.batch_size] for start in range(0, len(order), sampling.batch_size)]
    if lockstep_calls is not None:
        if lockstep_calls < len(batches):
            raise ValueError(f"lockstep_calls={lockstep_calls} is fewer than this rank's {len(batches)} batches")
        batches += [[] for _ in range(lockstep_calls - len(batches))]  # a dummy call each, outputs dropped
    was_training = model.training
    model.eval()
    done: dict[int, Generation] = {}
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[device] if device.type != "cpu" else []))
            step = stack.enter_context(lockstep(model)) if lockstep_calls is not None else None
            torch.manual_seed(sampling.seed + rank)
            for chunk in batches:
                asked = [dataset.prompt(i) for i in chunk]
                prompts = [a[0] for a in asked] or [dummy_prompt(pad)]
                inputs = prompt_inputs(model, left_pad(prompts, pad), device)
                if step is None:
                    tokens = model.generate(**inputs, **model_kwargs(model), generation_config=config)  # [B, S + new]
                else:
                    tokens = step(inputs, config if chunk else one_token(config))
                for b, (i, (_, conv)) in enumerate(zip(chunk, asked)):
                    new = tokens[b, inputs["input_ids"].shape[1] :].tolist()
                    new = new[: new.index(im_end)] if im_end in new else new  # then pads, once a row ends
                    prompt = "\n".join(f"{role}: {text}" for role, text in conv.turns[:-1])
                    images = [str(r.path) if r.path is not None else r.label for r in dataset.image_refs(i, conv)]
                    reply = reply_text(tok, new)
                    done[i] = Generation(i, prompt, images, conv.reference, reply, new)
    finally:
        model.train(was_training)
    return [done[i] for i in indices]


def model_inputs(model: nn.Module) -> set[str]:
    """The prompt keys ``model``'s forward takes: a family whose HF forward has no ``mm_token_type_ids`` (the
    Omni thinkers) gets the prompt without it (``generate`` refuses a key its forward does not take)."""
    return {"input_ids", "attention_mask", *inspect.signature(type(model).forward).parameters}


def prompt_inputs(model: nn.Module, prompt: dict[str, torch.Tensor], device) -> dict:
    """A (left-padded) prompt batch as ``model.generate`` takes it, on ``device``: the keys its forward takes
    (:func:`model_inputs`), under its names. An Omni thinker's (HF's class or the kit's) gets the video
    seconds as ``video_second_per_grid`` and ``use_audio_in_video`` for a heard video
    (:func:`qwenkit.model.families.omni.thinker_keywords`): HF's ``generate`` places the prompt's positions from
    them before the first forward, and without the seconds it fails on any video."""
    keys = model_inputs(model)
    if "video_second_per_grid" in keys:
        prompt = thinker_keywords(model.config, prompt, prompt["input_ids"])
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in prompt.items() if k in keys}


def dummy_prompt(pad_token_id: int) -> dict[str, torch.Tensor]:
    """The prompt of a lockstep call a rank makes without rows: one text token (its vision calls are idle ones)."""
    return {"input_ids": torch.tensor([[pad_token_id]]), "attention_mask": torch.ones(1, 1, dtype=torch.long)}


def one_token(config: GenerationConfig) -> GenerationConfig:
    """A dummy call's settings: one new token, greedy; ``synced_gpus`` keeps it stepping with the others."""
    one = GenerationConfig.from_dict(config.to_dict())
    one.max_new_tokens, one.do_sample = 1, False
    return one


def share(indices: list[int], rank: int, world_size: int) -> list[int]:
    """The rows rank ``rank`` generates: every ``world_size``-th, from its rank on."""
    return indices[rank::world_size]


def gather_rows(rows: list[Generation], rank: int, world_size: int) -> list[Generation] | None:
    """Every rank's rows on rank 0, in row order (collective); other ranks get ``None``."""
    if world_size == 1:
        return sorted(rows, key=lambda r: r.index)
    parts = [None] * world_size if rank == 0 else None
    dist.gather_object(rows, parts, dst=0)
    if rank != 0:
        return None
    return sorted((r for part in parts for r in part), key=lambda r: r.index)


def write_jsonl(rows: list[Generation], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r.to_json()) + "\n")
    return path
