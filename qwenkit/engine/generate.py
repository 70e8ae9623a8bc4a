"""Generation on held-out rows, sharded over the ranks and batched: did the fine-tune help?

:func:`generate_rows` runs HF ``generate`` on each row's prompt (every turn before the row's
last assistant reply) in batches of :attr:`Sampling.batch_size` prompts, left-padded, with the KV
cache, greedy unless :attr:`Sampling.temperature` > 0; each reply ends at ``<|im_end|>`` or after
``max_new_tokens``. :func:`gather_rows` brings every rank's rows to rank 0 in row order, where
:func:`write_jsonl` keeps prompt, image paths, reference, reply (text and token ids) and every
metric's score (:mod:`qwenkit.engine.answers`) of every row.

**Batched equals one row at a time.** A left-padded row ends at the same column as every other,
its pad positions masked out of attention; HF's Qwen2.5-VL ``get_rope_index`` computes each
row's mRoPE positions from its unmasked tokens alone (``attention_mask`` selects them) and keeps
the per-row offset (``rope_deltas``) for the decoding steps, so a row's greedy tokens do not
depend on its batch (fp32: tests check it token for token, with images, a video, text-only rows
and prompts of different lengths in one batch). Nothing here is Qwen2.5-specific: any model
whose ``generate`` takes the dataset's prompt keys works, ``input_ids`` and the per-token keys of
:data:`PAD` left-padded, every other key (pixels, grids) concatenated in row order.

**Every rank generates its share** (rows ``r, r + W, ...`` of the requested ones, longest samples
first so a batch wastes little padding) **from a full copy of the weights** (:func:`unsharded_copy`):
one ``get_model_state_dict(full_state_dict=True)`` gather onto every rank's device (one full
copy per device, beside the rank's shards, optimizer state and a batch's KV cache; on CPU ranks
one copy per rank in host memory). That is the limit: a model whose full
copy does not fit one device beside its training shards cannot run ``eval_accuracy`` this way
(it fails with the device's out-of-memory error at the gather). The sharded alternative, every
rank stepping the FSDP2 model in lockstep (HF's ``synced_gpus``: each forward of a sharded model
is a collective, so a rank that finished keeps stepping until all have, and the vision tower must
run on every rank for every batch), is not built; it is needed only when a full copy does not
fit one device. Generation from the copy is exactly generation from what ``qwenkit export``
writes (tests check that).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import GenerationConfig

from qwenkit.distributed.meta import build_on_meta
from qwenkit.model import lora
from qwenkit.records import read_jsonl as read_jsonl  # the one JSONL reader; eval/step-*.jsonl are read by it

log = logging.getLogger(__name__)

# per-token prompt keys other than input_ids (padded with the pad token id), and their pad values
PAD = {"attention_mask": 0, "mm_token_type_ids": 0}


@dataclass(frozen=True)
class Sampling:
    """How replies are generated: ``train.eval_max_new_tokens``, ``eval_batch_size``,
    ``eval_temperature`` (0: greedy), ``eval_top_p``; ``seed`` seeds sampling (with the rank)."""

    max_new_tokens: int
    batch_size: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def of(cls, train_cfg, **changes) -> Sampling:
        t = train_cfg
        settings = dict(max_new_tokens=t.eval_max_new_tokens, batch_size=t.eval_batch_size,
                        temperature=t.eval_temperature, top_p=t.eval_top_p, seed=t.seed)  # fmt: skip
        return cls(**{**settings, **changes})


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
        batch[key] = torch.cat([p[key] for p in prompts if key in p])
    return batch


def generation_config(sampling: Sampling, eos_token_id: int, pad_token_id: int) -> GenerationConfig:
    if sampling.temperature > 0:
        how = dict(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    else:
        how = dict(do_sample=False)
    return GenerationConfig(max_new_tokens=sampling.max_new_tokens, num_beams=1, eos_token_id=eos_token_id,
                            pad_token_id=pad_token_id, **how)  # fmt: skip


@torch.no_grad()
def generate_rows(model: nn.Module, dataset, indices: list[int], sampling: Sampling, rank: int = 0) -> list[Generation]:
    """Replies of ``model`` to the prompts of ``dataset[indices]``, in the order of ``indices``.

    ``dataset``: ``prompt(i) -> (inputs, conversation)``, ``image_refs(i, conversation)``,
    ``lengths`` and ``processor`` (:class:`qwenkit.data.dataset.EncodedDataset`). Prompts are
    batched longest first (by the index's sample length, reply included: sorting loads no media);
    ``batch_size=1`` is one row per ``generate`` call, unpadded.
    Sampling (temperature > 0) draws from its own generator state seeded by ``seed + rank``:
    the training RNG is left where it was.
    """
    tok = dataset.processor.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    pad = dataset.processor.pad_token_id
    config = generation_config(sampling, im_end, pad)
    device = next(model.parameters()).device
    order = sorted(indices, key=lambda i: -int(dataset.lengths[i]))  # stable: ties keep their order
    was_training = model.training
    model.eval()
    done: dict[int, Generation] = {}
    try:
        with torch.random.fork_rng(devices=[device] if device.type != "cpu" else []):
            torch.manual_seed(sampling.seed + rank)
            for start in range(0, len(order), sampling.batch_size):
                chunk = order[start : start + sampling.batch_size]
                asked = [dataset.prompt(i) for i in chunk]
                inputs = {k: v.to(device) for k, v in left_pad([a[0] for a in asked], pad).items()}
                tokens = model.generate(**inputs, generation_config=config)  # [B, S + new]
                for b, (i, (_, conv)) in enumerate(zip(chunk, asked)):
                    new = tokens[b, inputs["input_ids"].shape[1] :].tolist()
                    new = new[: new.index(im_end)] if im_end in new else new  # then pads, once a row ends
                    prompt = "\n".join(f"{role}: {text}" for role, text in conv.turns[:-1])
                    images = [str(r.path) if r.path is not None else r.label for r in dataset.image_refs(i, conv)]
                    reply = tok.decode(new, skip_special_tokens=True)
                    done[i] = Generation(i, prompt, images, conv.turns[-1][1], reply, new)
    finally:
        model.train(was_training)
    return [done[i] for i in indices]


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


def unsharded_copy(model: nn.Module, cls: type[nn.Module], device: torch.device, keep: bool = True) -> nn.Module | None:
    """A plain ``cls`` holding the full weights of the (possibly FSDP2-sharded) ``model``, on ``device``.

    Collective: every rank must call it; a rank with ``keep=False`` takes part in the gather and
    gets ``None``. Every rank receives the full tensors where its shards live (``cpu_offload``
    would hand them to rank 0 only). The copy is built with parameters on meta (buffers such as
    rotary ``inv_freq`` computed for real), then takes the gathered tensors, so it never
    initialises weights it would overwrite.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if not keep:
        return None
    adapters = lora.has_adapters(model)
    if adapters:  # merging writes into the base weights: they must be the copy's own
        state = _unshared(state, model)
    copy = build_on_meta(cls, model.config)
    if adapters:  # the same adapters, then merged as the export's --merge does
        from peft import inject_adapter_in_model

        targets, _ = lora.target_problems(copy, model.qwenkit_lora)
        inject_adapter_in_model(lora.peft_config(model.qwenkit_lora, targets), copy, low_cpu_mem_usage=True)
    copy.load_state_dict(state, strict=True, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        copy.lm_head.weight = copy.model.language_model.embed_tokens.weight
    if adapters:
        lora.merge_in_place(copy)
    return copy.to(device).eval()


def _unshared(state: dict, model: nn.Module) -> dict:
    """``state`` with every tensor that shares storage with ``model``'s parameters cloned.

    On one rank a "gathered" full tensor can be the training parameter itself (the one shard,
    already on the CPU): a copy that changes its weights in place would change the model's.
    """
    local = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    owned = {t.untyped_storage().data_ptr() for t in local}
    return {k: v.clone() if v.untyped_storage().data_ptr() in owned else v for k, v in state.items()}

