"""FSDP2 on 2 gloo ranks with video rows: one rank's micro-batch has images only (or only text),
the other's images and a video (two vision-tower calls). FSDP's collectives must still pair up, and the
gradients must equal one process's over both micro-batches."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from multiproc import check_ranks

from qwenkit import config as qconfig
from qwenkit.distributed import fsdp

FP32 = dict(rtol=1e-5, atol=1e-5)  # sums over ranks run in another order


def _write_rows(root):
    from PIL import Image
    from videos import write_video

    write_video(root / "clip.avi", 96, 72, 20, 10)
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "red.png")
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    reply = {"role": "assistant", "content": "A red box and a moving square."}
    rows = [
        {"messages": [user("<image>What is it?"), reply], "images": ["red.png"]},
        {"messages": [user("<image>and<video>?"), reply], "images": ["red.png"], "videos": ["clip.avi"]},
        {"messages": [user("No picture today?"), reply]},
    ]
    (root / "data.json").write_text(json.dumps(rows))
    return root / "data.json"


def _batches(path, ranks_rows):
    from qwenkit.data import build
    from qwenkit.model.paths import load_processor

    cfg = qconfig.load(overrides=[f"data.path={path}", "data.shuffle=false", "train.micro_batch_size=1"])
    bundle = build(cfg, load_processor(cfg))
    batches = [bundle.collator([bundle.dataset[i] for i in rows]) for rows in ranks_rows]
    for b in batches:
        b.pop("num_samples")
    return batches, sum(b.pop("num_items") for b in batches)


CASES = {"image|image+video": ([0], [1]), "text|image+video": ([2], [1])}  # 1 and 2 idle calls on rank 0


def _ranks(rank, out):
    from conftest import build_model  # tests/ is on the spawned ranks' sys.path

    dist.init_process_group("gloo")
    rt = fsdp.Runtime(rank, 2, rank, torch.device("cpu"), "gloo", False)
    for name, ranks_rows in CASES.items():
        batches, total = _batches(out / "data.json", ranks_rows)
        model = build_model(chunk=True, seed=4)
        model.vision_calls_per_step = 2  # images and videos
        model.train()
        fsdp.shard(model, qconfig.load().parallel, fsdp.build_mesh(rt))
        (model(**batches[rank], num_items_in_batch=total).loss * 2).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            ref = build_model(chunk=True, seed=4)
            for b in batches:
                ref(**b, num_items_in_batch=total).loss.backward()
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, **FP32, msg=lambda m, n=n, c=name: f"{c}: {n}: {m}")
            (out / name.replace("|", "-")).write_text("ok")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_with_different_media_agree(tmp_path, tiny_path):
    pytest.importorskip("av")
    _write_rows(tmp_path)
    check_ranks(_ranks, 2, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*-*")) == sorted(n.replace("|", "-") for n in CASES)
