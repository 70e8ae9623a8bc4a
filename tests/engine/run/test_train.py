"""The training loop: a NaN stops the step before the update, the profiler window (the LR schedule: engine/run/test_optim.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from multiproc import check_ranks
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.engine.run import metrics, train

BASE = ["train.micro_batch_size=2", "data.tiny_samples=16", "train.resume=none", "checkpoint.save_final=false"]
POISONED_BATCH = 2  # the third micro-batch of rank 1: step 3 with grad_accum=1


def _poisoned(rank):
    """qwenkit.data.build whose rank-1 micro-batch POISONED_BATCH has NaN pixels."""

    def build(cfg, processor, rank_, world_size):
        bundle = data.build(cfg, processor, rank_, world_size)
        batches = bundle.batches

        def poisoned():
            for i, batch in enumerate(batches()):
                if rank == 1 and i == POISONED_BATCH:
                    batch["pixel_values"] = torch.full_like(batch["pixel_values"], float("nan"))
                yield batch

        bundle.batches = poisoned
        return bundle

    return build


def _worker(rank, out):
    dist.init_process_group("gloo")
    profiled = qconfig.load(
        overrides=BASE + [
            "train.steps=3", "profile.enabled=true", "profile.wait=1", "profile.warmup=1", "profile.active=1",
            "profile.memory_snapshot=true", f"train.output_dir={out / 'profiled'}",
        ]
    )  # fmt: skip
    train.run(profiled)
    cfg = qconfig.load(overrides=BASE + ["train.steps=5", "checkpoint.every=1", f"train.output_dir={out / 'nan'}"])
    trainer = train.Trainer(cfg, _poisoned(rank))
    with pytest.raises(train.NonFiniteError) as caught:
        trainer.run()
    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"step": caught.value.step, "message": str(caught.value), "state": state}, out / "nan.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def out(tmp_path_factory, tiny_path):  # tiny_path: written before the ranks start (see test_fsdp)
    out = tmp_path_factory.mktemp("train")
    check_ranks(_worker, 2, out)
    return out


@pytest.mark.slow
def test_nan_on_one_rank_stops_every_rank_before_the_update(out, tmp_path):
    got = torch.load(out / "nan.pt")
    assert got["step"] == POISONED_BATCH + 1
    assert got["message"].startswith("step 3: non-finite loss nan")
    assert sorted(metrics.series(metrics.read(out / "nan"), "loss", rank=1)) == [1, 2]
    # the weights are still those of the checkpoint written after step 2, bit for bit
    dcp_to_torch_save(out / "nan" / "checkpoints" / "step-00000002", tmp_path / "step2.pt")
    saved = torch.load(tmp_path / "step2.pt")["model"]
    assert saved.keys() == got["state"].keys()
    for key, value in saved.items():
        assert torch.equal(value, got["state"][key]), key


@pytest.mark.slow
def test_profiler_window_writes_traces_and_memory(out):
    for rank in (0, 1):
        trace = json.loads((out / "profiled" / "profile" / f"rank-{rank:05d}.json").read_text())
        assert trace["traceEvents"]
        memory = json.loads((out / "profiled" / "memory" / f"rank-{rank:05d}.json").read_text())
        assert memory["step"] == 3 and memory["peak_rss_mib"] > 0
