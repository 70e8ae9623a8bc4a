"""Generation and exact-match accuracy on held-out rows: did the fine-tune help?

:func:`generate_rows` runs HF ``generate`` (greedy, ``max_new_tokens``) on each row's prompt,
every turn before the row's last assistant reply, and compares the reply with that reference
(:func:`exact_match`: case and whitespace normalised). :func:`write_jsonl` keeps prompt, image
paths, reference and generated reply of every row.

**Under FSDP2, generation runs on rank 0 from exported weights** (:func:`unsharded_copy`):
every rank takes part in one ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``
gather, rank 0 loads the full tensors into a plain (unsharded) copy of the model and generates
while the others wait in the broadcast of its result (:meth:`qwenkit.engine.evaluate.Evaluator.accuracy`).
Why not generate on the sharded model on every rank: greedy decoding stops at a different step on each rank, and each forward of a sharded model is
a collective, so the ranks would have to keep stepping in lockstep (HF's ``synced_gpus``) and
align the vision tower too. The copy costs the full model once in rank 0's host memory and, on
an accelerator, its device memory while it generates; it is exactly what ``qwenkit export``
writes, so generation in training equals generation from the export (tests check that).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import GenerationConfig

from qwenkit.distributed.meta import build_on_meta
from qwenkit.model import lora
from qwenkit.records import read_jsonl as read_jsonl  # the one JSONL reader; eval/step-*.jsonl are read by it

log = logging.getLogger(__name__)


def normalise(text: str) -> str:
    """Lower case, runs of whitespace become one space, no leading or trailing space."""
    return " ".join(text.lower().split())


def exact_match(generated: str, reference: str) -> bool:
    return normalise(generated) == normalise(reference)


@dataclass
class Generation:
    index: int  # row of the eval dataset
    prompt: str  # the turns before the reply, one "role: text" line each
    images: list[str]  # image paths (or labels of embedded images)
    reference: str
    generated: str

    @property
    def match(self) -> bool:
        return exact_match(self.generated, self.reference)

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "prompt": self.prompt,
            "images": self.images,
            "reference": self.reference,
            "generated": self.generated,
            "match": self.match,
        }


def accuracy(rows: list[Generation]) -> float:
    """Fraction of exact matches (0 for no rows)."""
    return sum(r.match for r in rows) / len(rows) if rows else 0.0


@torch.no_grad()
def generate_rows(model: nn.Module, dataset, indices: list[int], max_new_tokens: int) -> list[Generation]:
    """Greedy replies of ``model`` to the prompts of ``dataset[indices]``, one row at a time.

    One row per ``generate`` call: no padding, so a row's tokens do not depend on its batch.
    """
    tok = dataset.processor.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
        eos_token_id=im_end, pad_token_id=dataset.processor.pad_token_id,
    )  # fmt: skip
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[Generation] = []
    try:
        for i in indices:
            inputs, conv = dataset.prompt(i)
            inputs = {k: v.to(device) for k, v in inputs.items()}
            tokens = model.generate(**inputs, generation_config=config)  # [1, S + new]
            new = tokens[0, inputs["input_ids"].shape[1] :]
            reply = tok.decode(new, skip_special_tokens=True)
            prompt = "\n".join(f"{role}: {text}" for role, text in conv.turns[:-1])
            images = [str(ref.path) if ref.path is not None else ref.label for ref in dataset.image_refs(i, conv)]
            out.append(Generation(i, prompt, images, conv.turns[-1][1], reply))
    finally:
        model.train(was_training)
    return out


def write_jsonl(rows: list[Generation], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r.to_json()) + "\n")
    return path


def unsharded_copy(model: nn.Module, cls: type[nn.Module], device: torch.device, main_rank: bool) -> nn.Module | None:
    """Rank 0: a plain ``cls`` holding the full weights of the (possibly FSDP2-sharded) ``model``.

    Collective: every rank must call it. Other ranks get ``None``. The copy is built with
    parameters on meta (buffers such as rotary ``inv_freq`` computed for real), then takes the
    gathered full tensors, so it never initialises weights it would overwrite.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not main_rank:
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

