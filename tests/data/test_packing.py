"""Padding-free packing: a packed row trains exactly like the padded micro-batch of the same samples.

References: the padded batch (loss, every gradient, logits), each sample run alone (positions,
logits), and the model's own ``get_rope_index`` on the padded batch (mRoPE rows).
"""

from __future__ import annotations

import pytest
import torch
from conftest import over_families, tiny_checkpoint

from qwenkit.data import Collator
from qwenkit.model.families import registry as families

IMAGES = (1, 0, 2, 1)  # images at different offsets: after text of random length, 2nd sample text-only


def samples_of(processor, batch) -> list[dict[str, torch.Tensor]]:
    """The per-sample dicts (as ``EncodedDataset`` yields them) of a right-padded test batch."""
    out, grid, patch = [], 0, 0
    for r, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        s = {k: batch[k][r, :n].long() for k in ("input_ids", "labels", "mm_token_type_ids")}
        ids = s["input_ids"]
        images = int((ids[1:][ids[:-1] == processor.vision_start_id] == processor.image_token_id).sum())
        if images:
            grids = batch["image_grid_thw"][grid : grid + images]
            patches = int(grids.prod(-1).sum())
            s["image_grid_thw"], s["pixel_values"] = grids, batch["pixel_values"][patch : patch + patches]
            grid, patch = grid + images, patch + patches
        out.append(s)
    return out


def forward_backward(model, batch):
    batch = dict(batch)
    n = batch.pop("num_items")
    batch.pop("num_samples")
    model.zero_grad(set_to_none=True)
    loss = model(**batch, num_items_in_batch=n).loss
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


# Qwen3-VL: per-sample interleaved mRoPE and DeepStack in a packed row; Qwen3.5: the linear-attention
# layers' conv window and recurrent state restart at each sample (qwenkit.model.families.linear_attention). (Not
# the MoEs: the router's aux loss is averaged over the padded batch's attention mask, which a packed row
# does not have.)
DENSE_FAMILIES = over_families("qwen2_5_vl", "qwen3_vl", "qwen3_5")


@DENSE_FAMILIES
@pytest.mark.parametrize("chunk", [True, False])
def test_packed_equals_padded_loss_and_every_gradient(family_processor, make_model, batch_factory, chunk):
    processor = family_processor
    samples = samples_of(processor, batch_factory(images_per_sample=IMAGES, seed=1))
    padded, packed = Collator(processor)(samples), Collator(processor, packing=True)(samples)
    assert packed["num_items"] == padded["num_items"]
    model = make_model(chunk=chunk, seed=0)
    loss_padded, grads_padded = forward_backward(model, padded)
    loss_packed, grads_packed = forward_backward(model, packed)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-6)
    assert grads_packed.keys() == grads_padded.keys()
    for name, g in grads_padded.items():  # vision tower, merger, decoder, embeddings, lm_head
        torch.testing.assert_close(grads_packed[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_no_attention_across_samples(processor, make_model, batch_factory):
    """Changing sample 2 leaves sample 1's logits alone; each sample's logits equal it run alone."""
    samples = samples_of(processor, batch_factory(images_per_sample=(1, 2, 0), seed=2))
    model = make_model(chunk=False, seed=0).eval()
    collate = Collator(processor, packing=True)

    def logits(batch):
        batch = {k: v for k, v in batch.items() if k not in ("labels", "num_items", "num_samples")}
        with torch.no_grad():
            return model(**batch).logits[0]  # [ΣL, V]

    before = logits(collate(samples))
    changed = dict(samples[1])
    text = changed["mm_token_type_ids"] == 0
    changed["input_ids"] = torch.where(text, (changed["input_ids"] + 7) % 100, changed["input_ids"])
    after = logits(collate([samples[0], changed, samples[2]]))
    n1, n2 = len(samples[0]["input_ids"]), len(samples[1]["input_ids"])
    torch.testing.assert_close(after[:n1], before[:n1], rtol=0, atol=1e-6)
    assert not torch.allclose(after[n1 : n1 + n2], before[n1 : n1 + n2])  # the change did reach sample 2
    start = 0
    for s in samples:
        alone = logits(Collator(processor)([s]))
        torch.testing.assert_close(before[start : start + len(s["input_ids"])], alone, rtol=1e-5, atol=1e-5)
        start += len(s["input_ids"])


def test_packed_collation(processor):
    def sample(ids, labels, **media):
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), **media}

    grid = torch.tensor([[1, 2, 2]])
    samples = [
        sample([5, 6, 7], [5, 6, 7], pixel_values=torch.ones(4, 3), image_grid_thw=grid),
        sample([8, 9], [8, 9], pixel_values_videos=torch.zeros(8, 3), video_grid_thw=torch.tensor([[2, 2, 2]]),
               second_per_grid_ts=torch.tensor([0.5])),
        sample([10], [-100], pixel_values=2 * torch.ones(4, 3), image_grid_thw=grid),
    ]  # fmt: skip
    packed = Collator(processor, packing=True)(samples)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert packed["labels"].tolist() == [[5, 6, 7, -100, 9, -100]]  # no sample predicts the next one's start
    assert packed["packed_seq_lens"].tolist() == [3, 2, 1] and "attention_mask" not in packed
    assert packed["num_items"] == Collator(processor)(samples)["num_items"] == 3
    assert packed["pixel_values"][:, 0].tolist() == [1] * 4 + [2] * 4 and packed["image_grid_thw"].shape == (2, 3)
    assert packed["video_grid_thw"].tolist() == [[2, 2, 2]] and packed["second_per_grid_ts"].tolist() == [0.5]
    assert packed["pixel_values_videos"].shape == (8, 3)
    alone = Collator(processor, packing=True)(samples[:1])  # one sample: a row without boundaries
    assert alone["labels"].tolist() == [[5, 6, 7]] and alone["packed_seq_lens"].tolist() == [3]


def test_packed_row_refuses_a_cache_and_a_mask(processor, make_model, batch_factory):
    packed = Collator(processor, packing=True)(samples_of(processor, batch_factory(images_per_sample=(0, 1))))
    model = make_model(chunk=False)
    inputs = {k: v for k, v in packed.items() if k not in ("num_items", "num_samples")}
    with pytest.raises(ValueError, match="use_cache=False"):
        model(**inputs, use_cache=True)
    with pytest.raises(ValueError, match="no attention_mask"):
        model(**inputs, attention_mask=torch.ones_like(packed["input_ids"]))


def _flash_attention_or_skip(device: str) -> None:
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        pytest.importorskip("flash_attn")
    else:
        torch_npu = pytest.importorskip("torch_npu")
        if not torch_npu.npu.is_available():
            pytest.skip("needs an Ascend NPU")


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("npu", marks=pytest.mark.npu)])
def test_flash_attention_packed_equals_padded(device, processor, make_model, batch_factory):
    """flash_attention_2 reads the packed boundaries from the text positions: flash-attn's varlen
    kernel (cu_seqlens) on CUDA; on Ascend transformers routes it to npu_fusion_attention with
    per-sample lengths."""
    _flash_attention_or_skip(device)
    samples = samples_of(processor, batch_factory(images_per_sample=IMAGES, seed=1))
    model = make_model(chunk=True, seed=0, attn_implementation="flash_attention_2").to(device, torch.bfloat16)
    to = lambda b: {k: v.to(device) for k, v in b.items()}  # noqa: E731
    loss_padded, _ = forward_backward(model, to(Collator(processor)(samples)))
    loss_packed, _ = forward_backward(model, to(Collator(processor, packing=True)(samples)))
    torch.testing.assert_close(loss_packed, loss_padded, rtol=2e-2, atol=2e-2)  # bf16


# ---------------------------------------------------------------------------------------------
# Through the trainer, on 2 gloo ranks

TRAIN_BASE = ["data.tiny_samples=48", "train.micro_batch_size=4", "train.steps=4", "train.warmup_steps=2"]
# ~5 samples per micro-batch; resuming across epoch ends is covered by test_data_sampler
BUDGET = ["data.packing=true", "data.max_tokens_per_batch=300", "data.max_length=300"]
TRAIN_RUNS = {  # name: overrides; "budget-resumed" stops after step 2 and resumes in a second run
    "padded": ["data.packing=false"],
    "packed": ["data.packing=true"],
    "budget": BUDGET,
    "budget-resumed": BUDGET,
    # Qwen3.5: packed rows through the linear-attention layers' per-sample path on gloo ranks
    "qwen3_5-padded": ["model.name=qwen3_5", "data.packing=false"],
    "qwen3_5-packed": ["model.name=qwen3_5", "data.packing=true"],
}


def _train_worker(rank, out):
    import torch.distributed as dist

    from qwenkit import config as qconfig
    from qwenkit.engine.run import train

    dist.init_process_group("gloo")
    for name, extra in TRAIN_RUNS.items():
        cfg = TRAIN_BASE + extra + [f"train.output_dir={out / name}"]
        if name == "budget-resumed":
            train.run(qconfig.load(overrides=cfg + ["train.stop_after=2", "train.resume=none"]))
            train.run(qconfig.load(overrides=cfg + ["train.resume=auto", "checkpoint.save_final=false"]))
        else:
            train.run(qconfig.load(overrides=cfg + ["train.resume=none", "checkpoint.save_final=false"]))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_path):  # tiny_path: written before the ranks start
    from multiproc import check_ranks

    out = tmp_path_factory.mktemp("packing")
    if not families.get("qwen3_5").unavailable():
        tiny_checkpoint("qwen3_5")  # written here, the ranks only read it
    else:  # transformers 4.57: no Qwen3.5 runs
        TRAIN_RUNS.pop("qwen3_5-padded"), TRAIN_RUNS.pop("qwen3_5-packed")
    check_ranks(_train_worker, 2, out, timeout=1800)  # five short runs; the default is for one
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["", "qwen3_5-"])
def test_two_ranks_packed_log_the_padded_loss_at_every_step(trained, family):
    from qwenkit.engine.run import metrics

    if f"{family}packed" not in TRAIN_RUNS:
        pytest.skip("transformers 4.57 has no Qwen3.5")
    for rank in (0, 1):
        padded, packed = ({m: metrics.series(metrics.read(trained / run / "metrics" / f"rank-{rank:05d}.jsonl"), m, rank)
                           for m in ("loss", "valid_tokens", "padding_fraction")} for run in (f"{family}padded", f"{family}packed"))
        assert sorted(padded["loss"]) == sorted(packed["loss"]) == list(range(1, 5))
        for step, loss in padded["loss"].items():
            assert packed["loss"][step] == pytest.approx(loss, rel=2e-4), step
        assert packed["valid_tokens"] == padded["valid_tokens"]
        assert set(packed["padding_fraction"].values()) == {0.0}
        assert all(p > 0 for p in padded["padding_fraction"].values())  # the padded run had padding to lose


@pytest.mark.slow
def test_token_budget_with_packing_resumes_bit_identical(trained):
    from qwenkit.engine.run import metrics

    for rank in (0, 1):
        straight = metrics.series(metrics.read(trained / "budget" / "metrics" / f"rank-{rank:05d}.jsonl"), "loss", rank)
        resumed = metrics.series(metrics.read(trained / "budget-resumed" / "metrics" / f"rank-{rank:05d}.jsonl"), "loss", rank)
        assert sorted(straight) == list(range(1, 5)) and resumed == straight
