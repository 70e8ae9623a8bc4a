"""The prepared index: cached by fingerprint (one test per input), written atomically, the same
from 1 process, 2 processes and 2 gloo ranks; header vs full image checks; bad samples met only
when loading (skip: replaced and counted on every rank; error: named by file and row)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from multiproc import check_ranks
from PIL import Image

from qwenkit import config as qconfig
from qwenkit.config import DataConfig
from qwenkit.data import BadSample, Collator, build, cache, read_dataset
from qwenkit.data.index import SampleIndex
from qwenkit.engine.run import metrics, train
from qwenkit.model.paths import load_processor
from qwenkit.model.processor import Processor

N_ROWS = 12
CORRUPT_ROW = 2  # its PNG has a damaged compressed stream: header and IEND intact


def noise_png(path: Path, seed: int, size=(64, 48)) -> None:
    rng = random.Random(seed)
    Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3))).save(path)


def damage_stream(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = data.find(b"IDAT") + 104
    data[at : at + 8] = bytes(8)
    path.write_bytes(bytes(data))


def write_set(root: Path, corrupt: bool = True, n: int = N_ROWS, missing=(5,)) -> Path:
    """``n`` one-image rows (distinct files); row CORRUPT_ROW's image damaged inside, rows in ``missing`` bad."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        noise_png(root / f"{i}.png", i, (64 + 8 * (i % 3), 48))
        image = f"{i}.png" if i not in missing else "gone.png"
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"<image>What is picture {i}?"},
                    {"role": "assistant", "content": "Noise. " * (1 + i % 4)},
                ],
                "images": [image],
            }
        )
    if corrupt:
        damage_stream(root / f"{CORRUPT_ROW}.png")
    path = root / "data.json"
    path.write_text(json.dumps(rows))
    return path


def data_cfg(path, tmp_path, **kw) -> DataConfig:
    overrides = {"data.path": str(path), "data.cache_dir": str(tmp_path / "cache"), "data.shuffle": False}
    return qconfig.load(overrides={**overrides, **{f"data.{k}": v for k, v in kw.items()}}).data


def same_index(a: SampleIndex, b: SampleIndex) -> None:
    assert a.columns.keys() == b.columns.keys()
    for k in a.columns:
        np.testing.assert_array_equal(a.columns[k], b.columns[k], err_msg=k)
    assert a.bad == b.bad and a.total == b.total


# ---------------------------------------------------------------------------------------------
# The cache and its fingerprint


def test_second_read_comes_from_the_cache_and_equals_the_scan(tmp_path, processor):
    path = write_set(tmp_path / "d")
    data = data_cfg(path, tmp_path)
    first, report = read_dataset(data, processor)
    assert first.index_origin.startswith("scanned 12 rows") and "index written to" in first.index_origin
    second, report2 = read_dataset(data, processor)
    assert second.index_origin.startswith("index from cache")
    same_index(first.index, second.index)
    assert report2.messages == report.messages and report2.total == report.total == N_ROWS
    assert [f.name for f in (tmp_path / "cache").iterdir()] == [
        cache.index_path(second.sources, processor, data).name
    ]
    for i in range(len(first)):
        x, y = first[i], second[i]
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert first.samples[3] == second.samples[3] and second.samples[3].grids == second.index.grids(3)
    assert isinstance(second.lengths, np.ndarray) and second.lengths.tolist() == [
        s.length for s in first.samples
    ]


def test_every_data_setting_is_classified():
    """A new data.* key must say whether it changes the index (then it is in the fingerprint)."""
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    assert fields == set(cache.ENCODING_KEYS) | set(cache.RUN_KEYS)
    assert not set(cache.ENCODING_KEYS) & set(cache.RUN_KEYS)


CHANGED = {
    "image_dir": "SET_TO_DATA_DIR",  # the same images found another way: still another key
    "layout": "messages",
    "system_prompt": "Be terse.",
    "max_length": 77,
    "truncate_text": True,
    "min_pixels": 28 * 28 * 2,
    "max_pixels": 28 * 28 * 64,
    "min_image_side": 30,
    "max_aspect_ratio": 100.0,
    "verify_images": "full",
    "video_dir": "SET_TO_DATA_DIR",
    "video_fps": 1.0,
    "video_min_frames": 2,
    "video_max_frames": 64,
    "video_max_pixels": 28 * 28 * 64,
    "video_total_pixels": 28 * 28 * 1024,
    "use_audio_in_video": True,  # a video's track joins the row's audios: toggling it rebuilds
}


@pytest.mark.parametrize("key", cache.ENCODING_KEYS)
def test_each_encoding_setting_changes_the_fingerprint(tmp_path, processor, tiny_path, key):
    path = write_set(tmp_path / "d", corrupt=False)
    read_dataset(data_cfg(path, tmp_path), processor)
    value = str(path.parent) if key in ("image_dir", "video_dir") else CHANGED[key]
    changed = data_cfg(path, tmp_path, **{key: value})
    proc = processor
    if key in ("min_pixels", "max_pixels"):  # as load_processor builds it for the run
        proc = Processor.from_pretrained(
            tiny_path, min_pixels=changed.min_pixels, max_pixels=changed.max_pixels
        )
    assert read_dataset(changed, proc)[0].index_origin.startswith("scanned")
    assert read_dataset(changed, proc)[0].index_origin.startswith("index from cache")


def test_run_settings_share_the_index(tmp_path, processor):
    path = write_set(tmp_path / "d", corrupt=False)
    read_dataset(data_cfg(path, tmp_path), processor)
    other = data_cfg(path, tmp_path, on_bad_sample="error", max_bad_fraction=0.5, num_proc=2, shuffle=True)
    assert read_dataset(other, processor)[0].index_origin.startswith("index from cache")


@pytest.mark.parametrize("change", ["mtime", "size", "tokenizer", "image_processor"])
def test_data_file_and_processor_change_the_fingerprint(tmp_path, tiny_path, change):
    processor = Processor.from_pretrained(tiny_path)
    path = write_set(tmp_path / "d", corrupt=False)
    data = data_cfg(path, tmp_path)
    read_dataset(data, processor)
    if change == "mtime":
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    elif change == "size":
        path.write_text(path.read_text() + "\n")
    elif change == "tokenizer":
        processor.tokenizer.add_tokens(["<|new_token|>"])
    else:
        processor.image_processor.image_std = [0.5, 0.5, 0.5]
    assert read_dataset(data, processor)[0].index_origin.startswith("scanned")


def test_content_fingerprint_sees_what_stat_does_not(tmp_path, processor):
    """The same size and mtime with other bytes: ``stat`` reuses the index, ``content`` rebuilds it."""
    path = write_set(tmp_path / "d", corrupt=False)
    stat_cfg, content_cfg = data_cfg(path, tmp_path), data_cfg(path, tmp_path, fingerprint="content")
    read_dataset(stat_cfg, processor)
    read_dataset(content_cfg, processor)
    st = path.stat()
    path.write_text(path.read_text().replace("picture 1?", "picture 9?"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert read_dataset(stat_cfg, processor)[0].index_origin.startswith("index from cache")
    assert read_dataset(content_cfg, processor)[0].index_origin.startswith("scanned")


def test_a_killed_writer_leaves_no_index_and_a_damaged_one_is_not_trusted(tmp_path, processor, monkeypatch):
    path = write_set(tmp_path / "d", corrupt=False)
    data = data_cfg(path, tmp_path)

    def killed(f, **arrays):
        f.write(b"PK\x03\x04 half an index")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez", killed)
    with pytest.raises(KeyboardInterrupt):
        read_dataset(data, processor)
    monkeypatch.undo()
    assert list((tmp_path / "cache").iterdir()) == []  # neither the index nor its temporary file
    dataset, _ = read_dataset(data, processor)
    index_file = cache.index_path(dataset.sources, processor, data)
    index_file.write_bytes(index_file.read_bytes()[:100])  # cut short by something else
    again, _ = read_dataset(data, processor)
    assert again.index_origin.startswith("scanned")
    same_index(again.index, dataset.index)


def test_resume_after_a_data_change_is_refused(tmp_path, processor):
    path = write_set(tmp_path / "d", corrupt=False, missing=())
    cfg = qconfig.load(
        overrides={
            "data.path": str(path),
            "data.cache_dir": str(tmp_path / "cache"),
            "train.micro_batch_size": 1,
        }
    )
    state = build(cfg, processor).sampler.state_dict()
    rows = json.loads(path.read_text())
    path.write_text(json.dumps(rows + rows[:1]))
    sampler = build(cfg, processor).sampler
    with pytest.raises(ValueError, match=r"cannot resume the data order.*num_samples: saved 12, now 13"):
        sampler.load_state_dict(state)


# ---------------------------------------------------------------------------------------------
# Scanning in parallel; memory


def test_two_processes_scan_what_one_does(tmp_path, processor):
    path = write_set(tmp_path / "d")
    one, _ = read_dataset(data_cfg(path, tmp_path, num_proc=1), processor, use_cache=False)
    two, _ = read_dataset(data_cfg(path, tmp_path, num_proc=2), processor, use_cache=False)
    assert "x 2 processes" in two.index_origin
    same_index(one.index, two.index)
    assert [b.row for b in one.index.bad] == [5]


# ---------------------------------------------------------------------------------------------
# Image checks: header by default, full on request and in `data check`; bad samples at load time


def test_full_verification_finds_what_the_header_check_cannot(tmp_path, processor):
    path = write_set(tmp_path / "d")
    header, _ = read_dataset(data_cfg(path, tmp_path), processor)
    full, report = read_dataset(data_cfg(path, tmp_path, verify_images="full"), processor)
    assert len(header) == N_ROWS - 1 and len(full) == N_ROWS - 2
    assert (
        f"{path}: row {CORRUPT_ROW}: corrupt_image: image 0 of 1 ('{CORRUPT_ROW}.png'): cannot decode"
        in report.messages[0]
    )


def test_bad_sample_at_load_time_skip_replaces_it_by_the_next_and_counts(tmp_path, processor):
    path = write_set(tmp_path / "d")
    dataset, _ = read_dataset(data_cfg(path, tmp_path, on_bad_sample="skip"), processor)
    got, nxt = dataset[CORRUPT_ROW], dataset[CORRUPT_ROW + 1]
    assert int(got.pop("num_bad")) == 1
    assert all(torch.equal(got[k], nxt[k]) for k in nxt) and got.keys() == nxt.keys()
    batch = Collator(processor)([dataset[1], dataset[CORRUPT_ROW]])
    assert int(batch["num_bad"]) == 1 and batch["input_ids"].shape[0] == 2
    assert "num_bad" not in Collator(processor)([dataset[0], dataset[1]])


def test_bad_sample_at_load_time_error_names_file_and_row(tmp_path, processor):
    path = write_set(tmp_path / "d")
    dataset, _ = read_dataset(data_cfg(path, tmp_path, on_bad_sample="error"), processor)
    with pytest.raises(
        BadSample,
        match=rf"{path}: row {CORRUPT_ROW}: corrupt_image: image 0 of 1 \('{CORRUPT_ROW}.png'\): cannot decode",
    ):
        dataset[CORRUPT_ROW]


def _two_ranks(rank, out: Path, path: Path):
    """Scan ``path`` on 2 ranks x 2 processes (results to files), then train 2 steps on that index."""
    dist.init_process_group("gloo")
    cfg = qconfig.load(
        overrides=[
            f"data.path={path}", f"data.cache_dir={out / 'cache'}", "data.shuffle=false", "data.on_bad_sample=skip",
            "data.max_bad_fraction=0.2", "train.micro_batch_size=2", "train.steps=2", "train.resume=none",
            "checkpoint.save_final=false", f"train.output_dir={out / 'run'}",
        ]
    )  # fmt: skip
    scan_cfg = dataclasses.replace(cfg.data, num_proc=2)
    dataset, report = read_dataset(scan_cfg, load_processor(cfg), rank=rank, world_size=2)
    np.savez(out / f"rank{rank}.npz", **dataset.index.columns)
    (out / f"rank{rank}.json").write_text(
        json.dumps({"origin": dataset.index_origin, "messages": report.messages})
    )
    train.run(cfg)  # reads the index the scan above wrote
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("ranks")
    # 10 rows: row 5 is dropped at scan; rank 1 loads good samples 2, 3 in step 1, and 2 is corrupt
    path = write_set(out / "d", n=10)
    check_ranks(_two_ranks, 2, out, path)  # scan + 2 training steps per rank; CI machines are shared
    return out, path


@pytest.mark.slow
def test_two_ranks_gather_what_one_process_scans(two_ranks, tiny_path):
    out, path = two_ranks
    cfg = qconfig.load(overrides={"data.path": str(path), "data.cache_dir": str(out / "cache")})
    reference, report = read_dataset(cfg.data, load_processor(cfg, tiny_path), use_cache=False)
    for rank in (0, 1):
        got = np.load(out / f"rank{rank}.npz")
        for k, v in reference.index.columns.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)
        meta = json.loads((out / f"rank{rank}.json").read_text())
        assert meta["messages"] == report.messages
        assert "2 ranks x 2 processes" in meta["origin"]
    files = list((out / "cache").iterdir())
    assert len(files) == 1  # one writer, no temporary left
    same_index(SampleIndex.load(files[0])[0], reference.index)


@pytest.mark.slow
def test_training_skips_a_sample_bad_at_load_time_on_one_rank_and_every_rank_counts_it(two_ranks):
    out, _ = two_ranks
    for rank in (0, 1):
        series = metrics.series(metrics.read(out / "run"), "bad_samples", rank)
        assert series == {1: 1.0, 2: 0.0}, series


# ---------------------------------------------------------------------------------------------
# qwenkit data prepare / check
