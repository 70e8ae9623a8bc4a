"""Data pipeline: the real mllm_demo set end to end, the qwen2vl template against HF's chat
template, image grids against the image processor, every accepted input layout.

Bad-input cases live in data/test_report.py, the resumable order in data/test_sampler.py, the
collator's padding in data/test_collator.py, system prompts and truncation in data/test_template.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import hf_reference_ids, make_cfg, runs, write_png
from PIL import Image

from qwenkit import config as qconfig
from qwenkit.data import Collator, build, read_dataset
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.processor import Processor, needs_mm_token_type_ids

MLLM_DEMO = Path(__file__).resolve().parents[3] / "shared" / "data" / "mllm_demo" / "mllm_demo.json"  # a sibling of the checkout
needs_demo = pytest.mark.skipif(
    not MLLM_DEMO.is_file(), reason="the mllm_demo dataset is not on this machine"
)


@pytest.fixture(scope="module")
def run_processor(tiny_path):
    """The processor a default run builds: the tiny tokenizer with data.min_pixels/max_pixels."""
    d = qconfig.load().data
    return Processor.from_pretrained(tiny_path, min_pixels=d.min_pixels, max_pixels=d.max_pixels)


ROW = {
    "messages": [
        {"role": "user", "content": "<image>What is this?"},
        {"role": "assistant", "content": "A red box."},
        {"role": "user", "content": "And this one?<image>"},
        {"role": "assistant", "content": "A blue one."},
    ],
}


def write_two_image_set(root: Path, image_entries: list) -> Path:
    write_png(root / "img" / "a.png", (64, 48), (200, 30, 30))
    write_png(root / "img" / "b.png", (40, 90), (30, 30, 200))
    path = root / "data.json"
    path.write_text(json.dumps([dict(ROW, images=image_entries)]))
    return path


def encoded(dataset, i=0):
    return {k: v.clone() for k, v in dataset[i].items()}


def assert_same_samples(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


# ---------------------------------------------------------------------------------------------
# Acceptance: the real mllm_demo dataset


@needs_demo
def test_mllm_demo_through_processor_and_collator(run_processor):
    cfg = make_cfg(path=str(MLLM_DEMO), shuffle=False)
    bundle = build(cfg, run_processor)
    rows = json.loads(MLLM_DEMO.read_text())
    assert (len(bundle.dataset), bundle.report.total, bundle.report.skipped) == (6, 6, 0)
    batch = bundle.collator([bundle.dataset[i] for i in range(len(rows))])
    tok, ip = run_processor.tokenizer, run_processor.image_processor

    # reference grids and pixels: the image processor on the row's image files, in order
    files = [MLLM_DEMO.parent / p for row in rows for p in row["images"]]
    ref = ip(images=[Image.open(f).convert("RGB") for f in files], return_tensors="pt")
    assert len(files) == 8
    torch.testing.assert_close(batch["image_grid_thw"], ref["image_grid_thw"].long(), rtol=0, atol=0)
    torch.testing.assert_close(batch["pixel_values"], ref["pixel_values"], rtol=0, atol=0)

    image = 0
    for b, row in enumerate(rows):
        ids = batch["input_ids"][b][batch["attention_mask"][b].bool()]
        labels = batch["labels"][b][batch["attention_mask"][b].bool()]
        grids = batch["image_grid_thw"][image : image + len(row["images"])]
        image += len(row["images"])
        # one span of <|image_pad|> per image, t*h*w/merge² long, inside <|vision_start|>…<|vision_end|>
        spans = runs(ids == run_processor.image_token_id)
        assert [e - s for s, e in spans] == [int(g.prod()) // ip.merge_size**2 for g in grids]
        for s, e in spans:
            assert ids[s - 1] == run_processor.vision_start_id and ids[e] == run_processor.vision_end_id
        # the learned tokens are exactly the assistant replies, each closed by <|im_end|>
        learned = [tok.decode(labels[s:e]) for s, e in runs(labels != IGNORE_INDEX)]
        replies = [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
        assert learned == replies
        assert torch.equal(labels[labels != IGNORE_INDEX], ids[labels != IGNORE_INDEX])
    assert batch["num_items"] == (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    assert batch["num_samples"] == 6


@needs_demo
def test_mllm_demo_tokens_equal_hf_chat_template(run_processor):
    dataset, _ = read_dataset(make_cfg().data, run_processor, str(MLLM_DEMO))
    rows = json.loads(MLLM_DEMO.read_text())
    for i, row in enumerate(rows):
        assert dataset[i]["input_ids"].tolist() == hf_reference_ids(
            run_processor, row, dataset.samples[i].grids
        )


@needs_demo
def test_mllm_demo_batch_runs_through_the_model(run_processor, make_model):
    """The collated batch is what the model takes; images get 3-D mRoPE positions on 4.57 and 5.x."""
    bundle = build(make_cfg(path=str(MLLM_DEMO), shuffle=False), run_processor)
    batch = bundle.collator([bundle.dataset[i] for i in (0, 1)])
    assert ("mm_token_type_ids" in batch) == needs_mm_token_type_ids()
    num_items = batch.pop("num_items")
    batch.pop("num_samples")
    model = make_model(chunk=False).eval()
    with torch.no_grad():
        out = model(**batch)
    assert torch.isfinite(out.loss)
    assert num_items == (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    # mRoPE with images shifts positions: the rope deltas are non-zero only when 3-D positions were built
    assert model.model.rope_deltas is not None and bool((model.model.rope_deltas != 0).any())


def test_mm_token_type_ids_mark_image_pads(processor):
    dataset, _ = read_dataset(make_cfg(tiny_samples=3).data, processor, "tiny")
    sample = dataset[0]
    if not needs_mm_token_type_ids():
        assert "mm_token_type_ids" not in sample
        return
    assert torch.equal(sample["mm_token_type_ids"], (sample["input_ids"] == processor.image_token_id).long())
    assert sample["mm_token_type_ids"].sum() == processor.image_tokens(sample["image_grid_thw"][0])


# ---------------------------------------------------------------------------------------------
# Reading: files, directories, layouts, image entries, HF datasets


def test_jsonl_and_directories_read_like_json(tmp_path, processor):
    write_png(tmp_path / "img" / "a.png", (64, 48))
    rows = [
        dict(ROW, images=["img/a.png", "img/a.png"]),
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]
    (tmp_path / "one.json").write_text(json.dumps(rows))
    (tmp_path / "sub").mkdir()
    write_png(tmp_path / "sub" / "img" / "a.png", (64, 48))
    (tmp_path / "sub" / "two.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "one.json"}}))
    cfg = make_cfg()
    from_json, _ = read_dataset(cfg.data, processor, str(tmp_path / "one.json"))
    from_jsonl, _ = read_dataset(cfg.data, processor, str(tmp_path / "sub" / "two.jsonl"))
    assert_same_samples(from_json, from_jsonl)
    from_dir, report = read_dataset(cfg.data, processor, str(tmp_path))
    assert (len(from_dir), report.total, report.skipped) == (4, 4, 0)  # dataset_info.json is metadata
    for i in range(4):
        assert torch.equal(from_dir[i]["input_ids"], from_json[i % 2]["input_ids"])


def test_sharegpt_spelling_equals_messages(tmp_path, processor):
    write_png(tmp_path / "a.png")
    messages = [
        {"messages": [{"role": "system", "content": "S."}] + ROW["messages"][:2], "images": ["a.png"]},
    ]
    sharegpt = [
        {
            "system": "S.",
            "conversations": [
                {"from": "human", "value": "<image>What is this?"},
                {"from": "gpt", "value": "A red box."},
            ],
            "images": ["a.png"],
        }
    ]
    (tmp_path / "m.json").write_text(json.dumps(messages))
    (tmp_path / "s.json").write_text(json.dumps(sharegpt))
    cfg = make_cfg()
    assert_same_samples(
        read_dataset(cfg.data, processor, str(tmp_path / "m.json"))[0],
        read_dataset(cfg.data, processor, str(tmp_path / "s.json"))[0],
    )


def test_hf_datasets_object_saved_dir_and_parquet(tmp_path, processor):
    datasets = pytest.importorskip("datasets")
    json_path = write_two_image_set(tmp_path, ["img/a.png", "img/b.png"])
    reference = read_dataset(make_cfg().data, processor, str(json_path))[0]
    images = [Image.open(tmp_path / "img" / n) for n in ("a.png", "b.png")]
    ds = datasets.Dataset.from_dict(
        {"messages": [ROW["messages"]], "images": [images]},
        features=datasets.Features(
            {
                "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
                "images": [datasets.Image()],
            }
        ),
    )
    assert_same_samples(reference, read_dataset(make_cfg().data, processor, ds)[0])
    ds.save_to_disk(str(tmp_path / "saved"))
    assert_same_samples(reference, read_dataset(make_cfg().data, processor, str(tmp_path / "saved"))[0])
    (tmp_path / "pq").mkdir()
    ds.to_parquet(str(tmp_path / "pq" / "train.parquet"))
    assert_same_samples(reference, read_dataset(make_cfg().data, processor, str(tmp_path / "pq"))[0])
    # a built Dataset goes through build() too
    bundle = build(qconfig.load(overrides={"train.micro_batch_size": 1}), processor, source=ds)
    assert len(bundle.dataset) == 1


def test_tiny_goes_through_the_same_path(processor):
    cfg = qconfig.load(overrides={"data.tiny_samples": 6, "data.shuffle": False, "train.micro_batch_size": 3})
    bundle = build(cfg, processor)
    assert (len(bundle.dataset), bundle.report.skipped) == (6, 0)
    rows = json.loads(Path(bundle.dataset.sources[0].name).read_text())
    batch = next(bundle.batches())
    assert batch["input_ids"].shape[0] == 3 and batch["image_grid_thw"].shape == (3, 3)
    for b in range(3):
        labels = batch["labels"][b]
        learned = [processor.tokenizer.decode(labels[s:e]) for s, e in runs(labels != IGNORE_INDEX)]
        assert learned == [
            m["content"] + "<|im_end|>" for m in rows[b]["messages"] if m["role"] == "assistant"
        ]


# ---------------------------------------------------------------------------------------------
# Determinism, unreadable paths


def test_encoding_is_deterministic(processor):
    cfg = make_cfg(tiny_samples=4)
    a, _ = read_dataset(cfg.data, processor, "tiny")
    b, _ = read_dataset(cfg.data, processor, "tiny")
    collate = Collator(processor)
    x, y = collate([a[i] for i in range(4)]), collate([b[i] for i in range(4)])
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_unreadable_paths_say_why(tmp_path, processor):
    from qwenkit.data import DataError

    (tmp_path / "empty").mkdir()
    (tmp_path / "rows.csv").write_text("a,b\n")
    cases = [
        (tmp_path / "nope.json", "no such file or directory"),
        (tmp_path / "empty", "no .json/.jsonl files, no save_to_disk dataset"),
        (tmp_path / "rows.csv", "unsupported file type '.csv'"),
    ]
    for path, reason in cases:
        with pytest.raises(DataError, match=rf"data\.path='{path}': {reason}"):
            read_dataset(make_cfg().data, processor, str(path))
