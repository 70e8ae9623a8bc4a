"""Ulysses sequence parallelism: 2 (and 4) gloo ranks against one process on the same batch.

Each case builds the same tiny model (random weights) on every rank, computes the one-process
reference (the subclass's own chunked forward, itself tested against HF's), then runs the batch
split over an SP group: the group's losses must sum to the reference loss and the ranks'
gradients (summed, as FSDP's reduction does) must equal every reference gradient.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from conftest import build_model, make_batch
from multiproc import check_ranks
from test_model import _video_batch
from test_packing import samples_of

from qwenkit.data.collator import Collator
from qwenkit.distributed import sequence

FP32 = dict(rtol=1e-5, atol=1e-5)  # the bound; fp32, sums over ranks in another order


def _odd(batch, processor):
    """Pad the batch by one column when its length is even: S not divisible by the SP size."""
    if batch["input_ids"].shape[1] % 2:
        return batch
    out = dict(batch)
    for key, value in (("input_ids", processor.pad_token_id), ("attention_mask", 0), ("labels", -100),
                       ("mm_token_type_ids", 0)):  # fmt: skip
        out[key] = torch.nn.functional.pad(batch[key], (0, 1), value=value)
    return out


def cases(processor) -> dict[str, dict]:
    text = _odd(make_batch(processor, images_per_sample=(0, 0, 0), seed=3), processor)
    image = _odd(make_batch(processor, images_per_sample=(1, 0, 2), seed=10), processor)  # seed 10: an image crosses the middle
    video = _video_batch(processor)
    video = {k: v for k, v in video.items()}
    packed = Collator(processor, packing=True)(samples_of(processor, make_batch(processor, (1, 0, 2, 1), seed=5)))
    packed.pop("num_items"), packed.pop("num_samples")
    return {"text": text, "image": image, "video": video, "packed": packed}


def straddles(batch, token_id: int, n: int) -> bool:
    """Some placeholder run crosses a slice boundary of the padded sequence."""
    s = batch["input_ids"].shape[1]
    width = (s + (-s) % n) // n
    is_token = batch["input_ids"] == token_id
    return any(bool((is_token[:, k * width - 1] & is_token[:, k * width]).any()) for k in range(1, n))


def _loss_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}


def _equality_ranks(rank, out, names):
    dist.init_process_group("gloo")
    from qwenkit.model.processor import Processor
    from qwenkit.model.tiny import ensure_checkpoint

    processor = Processor.from_pretrained(ensure_checkpoint())
    world = dist.get_world_size()
    sp_size = 2
    sp = sequence.init_groups(rank, world, sp_size)
    base = build_model(chunk=True, seed=1)
    results = {}
    for name, batch in cases(processor).items():
        if name not in names:
            continue
        ref = copy.deepcopy(base)
        ref_loss, ref_grads = _loss_grads(ref, batch)
        model = copy.deepcopy(base)
        sequence.enable(model, sp)
        model.model.visual.sp_inputs = 0
        loss, grads = _loss_grads(model, batch)
        total = loss.clone()
        dist.all_reduce(total, group=sp.group)  # the group's slices sum to the whole loss
        worst = 0.0
        for key, ref_grad in ref_grads.items():
            g = grads[key] if grads[key] is not None else torch.zeros_like(ref.get_parameter(key))
            g = g.clone()
            dist.all_reduce(g, group=sp.group)
            if ref_grad is None:
                ref_grad = torch.zeros_like(g)
            torch.testing.assert_close(g, ref_grad, **FP32, msg=lambda m, k=key: f"{name} {k}: {m}")
            worst = max(worst, float((g - ref_grad).abs().max()))
        torch.testing.assert_close(total, ref_loss, **FP32)
        pixels = batch.get("pixel_values", batch.get("pixel_values_videos"))
        results[name] = {
            "loss": float(total), "ref_loss": float(ref_loss), "worst_grad_diff": worst,
            "vision_rows": model.model.visual.sp_inputs, "total_rows": 0 if pixels is None else pixels.shape[0],
            "straddles": straddles(batch, processor.image_token_id, sp_size)
            or straddles(batch, processor.video_token_id, sp_size),
        }  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def equality(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("sp_equal")
    check_ranks(_equality_ranks, 2, out, ["text", "image", "video", "packed"], timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", ["text", "image", "video", "packed"])
def test_two_ranks_equal_one_process(equality, name):
    r0, r1 = equality[0][name], equality[1][name]
    assert r0["loss"] == pytest.approx(r0["ref_loss"], rel=1e-5)
    assert r0["worst_grad_diff"] < 1e-5 and r1["worst_grad_diff"] < 1e-5


@pytest.mark.parametrize("name", ["image", "video"])
def test_a_placeholder_run_straddles_the_slice_boundary(equality, name):
    assert equality[0][name]["straddles"]


@pytest.mark.parametrize("name", ["image", "video", "packed"])
def test_each_rank_encodes_only_its_share(equality, name):
    rows = [equality[r][name]["vision_rows"] for r in range(2)]
    total = equality[0][name]["total_rows"]
    assert sum(rows) == total and all(0 < n < total for n in rows), rows


def test_partition_is_contiguous_and_balanced():
    assert sequence.partition([4, 4, 4, 4], 2) == [(0, 2), (2, 4)]
    assert sequence.partition([16], 2) == [(0, 1), (1, 1)]  # one unit: the other rank idles
    assert sequence.partition([1, 1, 8], 2) == [(0, 2), (2, 3)]
    bounds = sequence.partition([3, 5, 2, 7, 1, 4], 3)
    assert [b for _, b in bounds][-1] == 6 and all(a <= b for a, b in bounds)


def test_video_units_are_temporal_patches():
    assert sequence.vision_units(torch.tensor([[1, 4, 6], [3, 2, 2]])) == [(1, 4, 6, 24)] + [(1, 2, 2, 4)] * 3


def test_heads_not_divisible_are_refused():
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    assert sequence.heads_problem(cfg, 2) is None and sequence.heads_problem(cfg, 4) is None
    problem = sequence.heads_problem(cfg, 3)
    assert "4 query heads" in problem and "2 key/value heads" in problem
