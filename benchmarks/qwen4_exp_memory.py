"""Per-rank memory of fine-tuning the real Qwen4-Exp on 8, 16 and 32 GPUs: arithmetic, printed as the table of docs/PERFORMANCE.md.

The model is transformers' ``Qwen4ExpConfig()`` (its class defaults: 40 decoder layers of hidden 2048, 512 experts
of 512 top-10, 4 hyper-connection streams, the 27-block vision tower; the QSA indexer's sizes, unset there, from
:data:`INDEXER`) built on the meta device, so the counts are its real parameter shapes without any storage. The class defaults put PLE on no layer (``ple_layer_ids=None``);
``--ple-layers`` says which decoder layers carry an n-gram table (default: layer 1, one table of the config's
defaults, 320M rows x 128 columns: the "~45B entries" its comment warns about), each split over the ranks on its
columns (qwenkit/distributed/columns.py). Every other weight is FSDP2's, sharded on dim 0 over all ranks.

Per rank, with the kit's GPU settings (``model.dtype: float32`` masters, ``parallel.param_dtype: bfloat16``,
``parallel.reduce_dtype: float32``, AdamW): the checkpoint's bf16 weights / world (what a frozen DPO/GRPO reference
holds), and the training state: fp32 master + fp32 gradient + AdamW's two fp32 moments = 16 bytes per trainable
parameter / world (the QSA indexer is frozen: 4 bytes; with the tables frozen, ``model.freeze``, theirs too; under
LoRA every base weight: the adapters' state is megabytes). Plus FSDP2's gathered units: the largest decoder layer in
bf16, twice (one computing, the next prefetched). Activations, the chunked loss head's buffers, the allocator's slack
and the CUDA context are **not** counted: they depend on the sequence length and ``parallel.recompute``.

    python benchmarks/qwen4_exp_memory.py                 # the table for 8, 16, 32 GPUs
    python benchmarks/qwen4_exp_memory.py --ple-layers 1 5 --gpus 16 32 64
"""

from __future__ import annotations

import argparse

import torch

GiB = 2**30
# the QSA indexer's sizes, which the class leaves unset although its default layer types need them, and the partial
# rotary factor that lets RoPE fit the index head: as published Qwen4-Exp configs set them (the indexer holds a few
# million parameters in all, any choice moves the table by less than 0.1 GiB; RoPE holds none)
INDEXER = dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
               rope_parameters={"rope_type": "default", "rope_theta": 1.0e7, "partial_rotary_factor": 0.25})  # fmt: skip


def build_on_meta(ple_layers: list[int]):
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    text = {"ple_layer_ids": ple_layers, **INDEXER}
    if ple_layers:
        text["eos_token_id"] = 248046  # PLE needs one (its n-gram context restarts after it); no parameter depends on it
    with torch.device("meta"):
        return Qwen4ExpForConditionalGeneration(Qwen4ExpConfig(text_config=text))


def counts(model) -> dict[str, int]:
    """Parameters by what the arithmetic treats apart: the n-gram tables, the frozen indexer, the rest; and the
    largest FSDP2 unit (a decoder layer without its table: the table is outside FSDP)."""
    from qwenkit.model.families import registry as families

    entry = families.get("qwen4_exp")
    out = {"tables": 0, "indexer": 0, "rest": 0}
    for name, p in model.named_parameters():
        part = entry.part_of(name)
        key = {"n-gram tables": "tables", "QSA indexer": "indexer"}.get(part, "rest")
        out[key] += p.numel()
    layers = model.model.language_model.layers
    out["unit"] = max(sum(p.numel() for n, p in layer.named_parameters() if "ngram_embedding" not in n) for layer in layers)
    return out


def rows(n: dict[str, int], gpus: list[int]) -> list[dict[str, float]]:
    total = n["tables"] + n["indexer"] + n["rest"]
    out = []
    for world in gpus:
        state = (16 * (n["tables"] + n["rest"]) + 4 * n["indexer"]) / world  # master + grad + AdamW; indexer master
        frozen = state - 12 * n["tables"] / world  # the tables frozen: their masters stay, no gradient or moments
        gathered = 2 * 2 * n["unit"]  # bf16, two decoder layers in flight
        lora = 4 * total / world  # every base weight frozen: its fp32 master only (the adapters: megabytes)
        out.append(dict(gpus=world, weights=2 * total / world, tables=2 * n["tables"] / world, state=state,
                        gathered=gathered, full=state + gathered, frozen=frozen + gathered, lora=lora + gathered))  # fmt: skip
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ple-layers", type=int, nargs="*", default=[1], help="one-indexed decoder layers with PLE")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args(argv)
    n = counts(build_on_meta(args.ple_layers))
    total = n["tables"] + n["indexer"] + n["rest"]
    print(f"Qwen4ExpConfig() defaults, PLE on layers {args.ple_layers}: {total / 1e9:.2f}B parameters "
          f"({n['tables'] / 1e9:.2f}B in {len(args.ple_layers)} n-gram table(s), {n['indexer'] / 1e6:.1f}M QSA indexer, "
          f"largest decoder layer {n['unit'] / 1e9:.2f}B); bf16 checkpoint {2 * total / GiB:.1f} GiB")  # fmt: skip
    print("GiB per rank; activations not counted")
    print("| GPUs | bf16 weights (frozen reference) | of which n-gram tables | fp32 master + grad + AdamW | "
          "gathered units (bf16, 2 layers) | full fine-tune | n-gram tables frozen | LoRA |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows(n, args.gpus):
        print(f"| {r['gpus']} | {r['weights'] / GiB:.1f} | {r['tables'] / GiB:.1f} | {r['state'] / GiB:.1f} | "
              f"{r['gathered'] / GiB:.1f} | {r['full'] / GiB:.1f} | {r['frozen'] / GiB:.1f} | {r['lora'] / GiB:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
