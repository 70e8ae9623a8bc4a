"""count_all_gathers counts one gather per FSDP2 unit per forward, and one per unit for a whole
block under unshard.unsharded (whose forwards equal the sharded model's); a one-rank group counts as many would."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from multiproc import check_ranks
from torch import nn
from torch.distributed.fsdp import fully_shard

from qwenkit.bench.collectives import count_all_gathers
from qwenkit.distributed.unshard import unsharded


def _worker(rank, out):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)  # the root: its own unit, reshard_after_forward False by default
    x = torch.randn(3, 8)
    with torch.no_grad(), count_all_gathers() as sharded:
        want = [model(x) for _ in range(3)]
    with torch.no_grad(), count_all_gathers() as whole, unsharded(model):
        got = [model(x) for _ in range(3)]
    with torch.no_grad(), count_all_gathers() as after:
        model(x)
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    (out / f"rank-{rank}.json").write_text(json.dumps({"sharded": len(sharded), "whole": len(whole),
                                                       "after": len(after), "same": same}))  # fmt: skip
    dist.destroy_process_group()


def test_a_forward_gathers_every_unit_and_an_unsharded_block_none(tmp_path):
    for world in (1, 2):
        check_ranks(_worker, world, tmp_path, timeout=120)
        for rank in range(world):
            got = json.loads((tmp_path / f"rank-{rank}.json").read_text())
            # 3 forwards x 2 resharding layers (the root's parameterless unit gathers nothing); an
            # unsharded block: each layer once, on entering, whatever its forwards; then resharding again
            assert got == {"sharded": 3 * 2, "whole": 2, "after": 2, "same": True}, (world, got)
