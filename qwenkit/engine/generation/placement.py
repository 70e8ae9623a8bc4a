"""Where generation's weights come from (``train.eval_generation``, GRPO's rollouts): a full copy gathered on
every rank, or the FSDP2-sharded training model stepping in lockstep, and the ``auto`` rule between them.

Every rank generates its share of the rows (:func:`qwenkit.engine.generation.generate.generate_rows`) from
one of two places:

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
  :meth:`~qwenkit.model.families.chunked.ChunkLossMixin.idle_vision_term`, on a blank patch group: the same
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
import math
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import GenerationConfig

from qwenkit.device import free_memory_bytes
from qwenkit.distributed.meta import build_on_meta
from qwenkit.model import lora
from qwenkit.model.families import mtp
from qwenkit.model.families import registry as families

if TYPE_CHECKING:
    from qwenkit.engine.generation.sampling import Sampling


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


# the model's attributes lockstep generation sets, and restores after
_LOCKSTEP_STATE = ("chunk_loss", "sequence_parallel", "vision_calls_per_step")


@contextlib.contextmanager
def lockstep(model: nn.Module, synced: bool | None = None):
    """The sharded training ``model`` (a :class:`~qwenkit.model.families.chunked.ChunkLossMixin`) set up to
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
    cast of every weight kept beside them (:func:`qwenkit.engine.rollouts.hf.low_precision_gemms`)."""
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
    state = {k: v for k, v in state.items() if not k.startswith(mtp.PREFIX)}  # model.mtp.train's layer: HF's class has none
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
