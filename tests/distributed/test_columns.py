"""Qwen4-Exp's n-gram tables sharded on their columns (qwenkit.distributed.columns) on 2 (and 3) gloo ranks vs one process.

The tables are built on meta and read from the tiny checkpoint's split parts (``ngram_embedding.shard_<i>.weight``);
each rank holds its columns of every row (on 2 ranks half of every table's bytes) and never more; a forward and backward of a
different batch on each rank gives each rank's loss of one process, and every gradient (the tables', reduced by the
lookup's exchange; the rest FSDP2's) the one process's gradient of the ranks' mean loss. fp32 on both sides; the
tables' gradients are the same sums of rows in another order (tolerance of the other shared tests, test_fsdp.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import make_batch, tiny_checkpoint, tiny_processor
from multiproc import check_ranks
from torch.distributed.tensor import DTensor

from qwenkit import config as qconfig
from qwenkit.distributed import fsdp
from qwenkit.engine.run import build
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as families

pytestmark = pytest.mark.skipif(bool(why := families.get("qwen4_exp").unavailable()), reason=why or "")
FP32 = dict(rtol=1e-5, atol=1e-6)
TABLE = ".ple.ple_embedding.ngram_embedding.weight"


def _overrides(path):
    return ["model.name=qwen4_exp", f"model.path={path}", "loss.chunk=true", "loss.chunk_size=16"]


def _sharded_step(rank, out, path, world):
    dist.init_process_group("gloo")
    cfg = qconfig.load(overrides=[*_overrides(path), "model.init_device=meta"])
    rt = fsdp.Runtime(rank, world, rank, torch.device("cpu"), "gloo", False)
    model, _ = build.sharded_model(cfg, rt, build.meshes(cfg, rt))
    tables = {n: p for n, p in model.named_parameters() if n.endswith(TABLE)}
    held = {n: (p.to_local().numel() * p.element_size(), p.numel() * p.element_size()) for n, p in tables.items()}
    weights = {n: p.full_tensor() for n, p in tables.items()}  # what the ranks read from the parts
    loss = model(**torch.load(out / f"batch{rank}.pt")).loss
    loss.backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()
             if p.grad is not None}  # fmt: skip
    torch.save({"loss": loss.detach(), "held": held, "weights": weights, "grads": grads}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
# 2 ranks: each table's 8 columns split 4 + 4; 3 ranks (long tier): 3 + 3 + 2, the exchange's blocks padded to one width
@pytest.mark.parametrize("world, held", [(2, [4, 4]), pytest.param(3, [3, 3, 2], marks=pytest.mark.long)])
def test_tables_are_split_over_the_ranks_and_train_as_one_process(tmp_path, _cache, world, held):
    path = tiny_checkpoint("qwen4_exp")
    processor = tiny_processor("qwen4_exp")
    images = [(1, 0), (2,), (0, 1)][:world]  # ranks of different lengths: the exchange's blocks differ in size
    batches = [make_batch(processor, images_per_sample=n, seed=3 + r) for r, n in enumerate(images)]
    for r, batch in enumerate(batches):
        torch.save(batch, tmp_path / f"batch{r}.pt")
    check_ranks(_sharded_step, world, tmp_path, path, world)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    cfg = qconfig.load(overrides=_overrides(path))
    ref = registry.build(cfg.model, cfg.loss)  # from_pretrained: transformers joins the parts
    losses = [ref(**batch).loss for batch in batches]
    (sum(losses) / world).backward()  # FSDP2's gradient: the ranks' mean

    tables = {n: p for n, p in ref.named_parameters() if n.endswith(TABLE)}
    assert len(tables) == 2 and tables.keys() == got[0]["held"].keys()
    for r, rank in enumerate(got):  # never whole on a rank: its columns of every row only (2 ranks: half the bytes)
        for name, (mine, whole) in rank["held"].items():
            table = tables[name]
            assert whole == table.numel() * table.element_size() and table.shape[1] == sum(held), name
            assert mine == whole * held[r] // table.shape[1], name
        for name, table in tables.items():
            torch.testing.assert_close(rank["weights"][name], table.detach(), rtol=0, atol=0, msg=name)
    for r in range(world):
        torch.testing.assert_close(got[r]["loss"], losses[r].detach(), **FP32)
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert got[0]["grads"].keys() == grads.keys()
    assert all(grads[n].abs().sum() > 0 for n in tables)  # rows the batches look up
    for name, grad in grads.items():
        torch.testing.assert_close(got[0]["grads"][name], grad, **FP32, msg=name)
