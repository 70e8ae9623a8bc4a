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
first so a batch wastes little padding), from one of two places (``train.eval_generation``):

- ``gather``: **a full copy of the weights** on every rank (:func:`unsharded_copy`): one
  ``get_model_state_dict(full_state_dict=True)`` gather onto every rank's device, beside the
  rank's shards, optimizer state and a batch's KV cache (on CPU ranks one copy per rank in host
  memory). Each rank then generates alone, no collective until the rows are gathered; this is
  exactly generation from what ``qwenkit export`` writes (tests check that).
- ``lockstep``: **the FSDP2-sharded training model itself** (:func:`lockstep`), for a model whose
  full copy does not fit one rank. Each forward of a sharded model is a collective (every unit
  all-gathers its weights), so every rank must run the same forwards in the same order: HF's
  ``synced_gpus`` keeps a rank whose replies have ended stepping until every rank's have; every
  rank makes the same number of ``generate`` calls (a rank short of rows generates one token
  from a one-token dummy prompt, dropped); and every rank's prefill calls the vision tower as
  often as the rank that calls it most (the model's idle vision calls,
  :meth:`~qwenkit.model.chunked.ChunkLossMixin.idle_vision_term`, on a blank patch group: the same
  rule training follows for a micro-batch without images; DeepStack's outputs are part of it).
  The replies equal the copy's token for token (fp32, tested); LoRA adapters stay unmerged
  (equal up to rounding). Every forward all-gathers the weights, so it is slower than ``gather``.
- ``auto`` (the default): ``gather`` when :func:`copy_fits` on every rank, else ``lockstep``.
  The rule: the full copy (every parameter and buffer at its stored dtype), one batch's KV cache
  (``2 x layers x KV heads x head dim x eval_batch_size x (longest prompt + max_new_tokens)``) and a
  margin of a quarter of the copy (activations, logits, allocator slack) must fit the rank's free
  memory (:func:`qwenkit.device.free_memory_bytes`: the device's free bytes plus its allocator's
  unused cache; on CPU ranks the host's available memory divided by the ranks on the host).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import GenerationConfig

from qwenkit.data.collator import join_media
from qwenkit.device import free_memory_bytes
from qwenkit.distributed.meta import build_on_meta
from qwenkit.model import family as families
from qwenkit.model import lora
from qwenkit.model.positions import thinker_keywords
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
    (:func:`qwenkit.model.omni.thinker_keywords`): HF's ``generate`` places the prompt's positions from
    them before the first forward, and without the seconds it fails on any video."""
    keys = model_inputs(model)
    if "video_second_per_grid" in keys:
        prompt = thinker_keywords(model.config, prompt, prompt["input_ids"])
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in prompt.items() if k in keys}


def model_kwargs(model: nn.Module) -> dict:
    """Keywords every ``generate`` call passes to the model's forward: a router's auxiliary loss off.

    transformers 5.x computes a MoE's load-balancing loss in every forward whose config says
    ``output_router_logits``, labels or not, and with the KV cache a decoding step's router logits
    cover its new token only while the attention mask covers the whole row: with left padding the
    shapes disagree and ``load_balancing_loss_func`` raises. Generation has no loss to add it to;
    the routing, hence every token, is the same without it. One rule for HF's class (a gathered
    copy, ``qwenkit eval``) and the sharded training model (lockstep evaluation, GRPO's rollouts).
    """
    return {"output_router_logits": False} if families.of_model(model).aux_loss else {}


def dummy_prompt(pad_token_id: int) -> dict[str, torch.Tensor]:
    """The prompt of a lockstep call a rank makes without rows: one text token (its vision calls are idle ones)."""
    return {"input_ids": torch.tensor([[pad_token_id]]), "attention_mask": torch.ones(1, 1, dtype=torch.long)}


def one_token(config: GenerationConfig) -> GenerationConfig:
    """A dummy call's settings: one new token, greedy; ``synced_gpus`` keeps it stepping with the others."""
    one = GenerationConfig.from_dict(config.to_dict())
    one.max_new_tokens, one.do_sample = 1, False
    return one


# the model's attributes lockstep generation sets, and restores after
_LOCKSTEP_STATE = ("chunk_loss", "sequence_parallel", "vision_calls_per_step")


@contextlib.contextmanager
def lockstep(model: nn.Module, synced: bool | None = None):
    """The sharded training ``model`` (a :class:`~qwenkit.model.chunked.ChunkLossMixin`) set up to
    generate in lockstep; yields ``step(inputs, config, **generate_kwargs) -> tokens``, one collective
    ``generate`` call.

    While it is open the model returns logits (chunk loss off) for the whole sequence on every
    rank (sequence parallelism off: each rank generates its own rows), and its vision tower runs
    inside the prefill forward: transformers 5.x would encode images *before* the prefill, outside
    ``forward`` (``_prepare_multimodal_encoder_kwargs_for_generation``), where FSDP2 has not gathered
    the root's parameters (the tower's patch embedding) and where a rank without images would
    skip the collectives the others make. Each call agrees the prefill's vision calls with the
    other ranks (one all-reduce); a forward hook ends them after the prefill, since the decoding
    steps carry no pixels on any rank.

    ``synced=False``: the weights are whole for the block (:func:`qwenkit.distributed.unshard.unsharded`)
    and a forward is no collective, so each rank generates alone (no agreement, no ``synced_gpus``);
    None: synced whenever a process group of more than one rank is up.
    """
    if synced is None:
        synced = dist.is_initialized() and dist.get_world_size() > 1
    device = next(model.parameters()).device
    saved = {name: getattr(model, name) for name in _LOCKSTEP_STATE}
    model.chunk_loss, model.sequence_parallel, model.vision_calls_per_step = False, None, 0
    hook = model.register_forward_hook(lambda module, args, out: setattr(module, "vision_calls_per_step", 0))
    model._supports_mm_encoder_outputs = lambda: False  # the instance's answer, removed below

    def step(inputs: dict[str, torch.Tensor], config: GenerationConfig, **generate_kwargs) -> torch.Tensor:
        if synced:
            made = torch.tensor([("pixel_values" in inputs) + ("pixel_values_videos" in inputs)], device=device)
            dist.all_reduce(made, op=dist.ReduceOp.MAX)  # the prefill's tower calls of the rank that makes most
            model.vision_calls_per_step = int(made.item())
        return model.generate(**inputs, **model_kwargs(model), generation_config=config, synced_gpus=synced,
                              **generate_kwargs)  # [B, S + new]

    try:
        yield step
    finally:
        hook.remove()
        del model._supports_mm_encoder_outputs
        for name, value in saved.items():
            setattr(model, name, value)


def lockstep_calls(rows: int, world_size: int, batch_size: int) -> int:
    """``generate`` calls every rank makes in lockstep: the batches of the largest share."""
    return math.ceil(math.ceil(rows / world_size) / batch_size)


# ---------------------------------------------------------------------------------------------
# gather or lockstep (train.eval_generation)

COPY_MARGIN = 0.25  # of the copy's bytes: activations, logits and allocator slack beside it


def copy_bytes(model: nn.Module) -> int:
    """Bytes of a full copy of ``model``: every parameter (a DTensor counts its global size) and buffer."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_cache_bytes(config, batch_size: int, tokens: int, element_size: int) -> int:
    """One batch's KV cache: keys and values of every layer, ``tokens`` positions per row."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * batch_size * tokens * element_size


def copy_fits(copy: int, kv_cache: int, free: int) -> bool:
    """The ``auto`` rule: the copy, a batch's KV cache and a quarter of the copy fit ``free`` bytes."""
    return copy + kv_cache + COPY_MARGIN * copy <= free


def choose_generation(setting: str, model: nn.Module, sampling: Sampling, longest_prompt: int, device,
                      cast: torch.dtype | None = None) -> tuple[str, str]:  # fmt: skip
    """``(gather | lockstep, why)`` for ``train.eval_generation``; ``auto`` is collective (every
    rank asks, and ``gather`` needs the copy to fit on every one). ``cast``: the GEMMs run in it, from a
    cast of every weight kept beside them (:func:`qwenkit.engine.objectives.rollout.low_precision_gemms`)."""
    if setting != "auto":
        return setting, f"train.eval_generation={setting}"
    copy = copy_bytes(model)
    element = next(p for p in model.parameters() if p.is_floating_point()).element_size()
    if cast is not None:
        copy += copy * cast.itemsize // element
    kv = kv_cache_bytes(model.config, sampling.batch_size, longest_prompt + sampling.max_new_tokens, element)
    free = free_memory_bytes(device)
    if torch.device(device).type == "cpu":  # the host's memory: every rank on it makes a copy
        free //= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    fits = torch.tensor([int(copy_fits(copy, kv, free)), free], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    mode = "gather" if fits[0].item() else "lockstep"
    why = (f"auto: full copy {_size(copy)} + KV cache {_size(kv)} + {COPY_MARGIN:.0%} margin "
           f"{'fits' if mode == 'gather' else 'does not fit'} the {_size(fits[1].item())} free on the tightest rank")  # fmt: skip
    return mode, why


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


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

        inject_adapter_in_model(lora.peft_config(model.qwenkit_lora, copy), copy, low_cpu_mem_usage=True)
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

