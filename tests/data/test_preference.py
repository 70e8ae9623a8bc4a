"""Preference pairs (qwenkit.data.preference): every accepted layout reads to the same two samples
as the two SFT conversations it stands for (the reference: today's ``messages`` layout through the
SFT pipeline); bad pairs are named by file, row and reason; images are processed once per pair;
and the sampler never splits a pair across micro-batches or ranks."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import AUDIO_FAMILY, tiny_processor
from PIL import Image

from data.test_audio import write_tone
from qwenkit import config as qconfig
from qwenkit import data as qdata
from qwenkit.data import BadSample
from qwenkit.data.preference import PairCollator, PairDataset, pair_layout, split_pair
from qwenkit.data.report import Location

Q, GOOD, BAD = "What colour is the box?", "Red.", "Blue."


@pytest.fixture
def media(tmp_path):
    (tmp_path / "img").mkdir()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(tmp_path / "img" / "a.png")
    Image.new("RGB", (40, 90), (30, 30, 200)).save(tmp_path / "img" / "b.png")
    return tmp_path


ROWS = {
    "trl_plain": {"prompt": Q, "chosen": GOOD, "rejected": BAD, "images": ["img/a.png"]},
    "trl_conversational": {
        "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": Q}]}],
        "chosen": [{"role": "assistant", "content": GOOD}],
        "rejected": [{"role": "assistant", "content": BAD}],
        "images": ["img/a.png"],
    },
    "llamafactory": {
        "conversations": [{"from": "human", "value": "<image>" + Q}],
        "chosen": {"from": "gpt", "value": GOOD}, "rejected": {"from": "gpt", "value": BAD}, "images": ["img/a.png"],
    },  # fmt: skip
    "swift": {
        "messages": [{"role": "user", "content": "<image>" + Q}, {"role": "assistant", "content": GOOD}],
        "rejected_response": BAD, "images": ["img/a.png"],
    },  # fmt: skip
}


def _sft(reply, image="img/a.png"):
    return {"messages": [{"role": "user", "content": "<image>" + Q}, {"role": "assistant", "content": reply}],
            "images": [image]}  # fmt: skip


def _cfg(tmp_path, path, **over):
    return qconfig.load(overrides={"train.objective": "dpo", "data.path": str(path), "train.micro_batch_size": 1,
                                   "data.cache_dir": str(tmp_path / "cache"), **over})  # fmt: skip


def _write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("layout", list(ROWS))
def test_each_layout_reads_to_the_two_sft_samples_it_stands_for(media, processor, layout):
    pairs = PairDataset(qdata.build(_cfg(media, _write(media, [ROWS[layout]])), processor).dataset.samples)
    reference = qdata.build(qconfig.load(overrides={"data.path": str(_write(media, [_sft(GOOD), _sft(BAD)], "sft.jsonl")),
                                                    "data.cache_dir": str(media / "cache"),
                                                    "train.micro_batch_size": 1}), processor).dataset  # fmt: skip
    assert pair_layout(ROWS[layout]) == layout.split("_")[0]
    chosen, rejected = pairs[0]
    assert int(chosen.pop("pair_index")) == 0
    for got, want in ((chosen, reference[0]), (rejected, reference[1])):
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


# LLaMA-Factory's and ms-swift's pairwise rows carry an ``audios`` column as their SFT rows do (TRL has none)
AUDIO_ROWS = {
    "llamafactory": {
        "conversations": [{"from": "human", "value": "<audio>" + Q}],
        "chosen": {"from": "gpt", "value": GOOD}, "rejected": {"from": "gpt", "value": BAD}, "audios": ["a.wav"],
    },  # fmt: skip
    "swift": {
        "messages": [{"role": "user", "content": "<audio>" + Q}, {"role": "assistant", "content": GOOD}],
        "rejected_response": BAD, "audios": ["a.wav"],
    },  # fmt: skip
}


@AUDIO_FAMILY
@pytest.mark.parametrize("layout", list(AUDIO_ROWS))
def test_a_pairs_audios_read_as_its_sft_samples_do(tmp_path, family, layout):
    """An Omni thinker's pair with an audio: both sides hear it, as the two SFT rows they stand for do (ids,
    features and masks equal); dropping the column left ``<audio>`` without its audio, a bad pair."""
    write_tone(tmp_path / "a.wav", hz=300.0, seconds=1.3, channels=1, rate=16_000)
    over = {"model.name": family, "data.cache_dir": str(tmp_path / "cache")}
    processor = tiny_processor(family)
    pairs = PairDataset(qdata.build(_cfg(tmp_path, _write(tmp_path, [AUDIO_ROWS[layout]]), **over), processor).dataset.samples)
    sft = [{"messages": [{"role": "user", "content": "<audio>" + Q}, {"role": "assistant", "content": r}],
            "audios": ["a.wav"]} for r in (GOOD, BAD)]  # fmt: skip
    reference = qdata.build(qconfig.load(overrides={"data.path": str(_write(tmp_path, sft, "sft.jsonl")),
                                                    "train.micro_batch_size": 1, **over}), processor).dataset  # fmt: skip
    chosen, rejected = pairs[0]
    chosen.pop("pair_index")
    for got, want in ((chosen, reference[0]), (rejected, reference[1])):
        assert got.keys() == want.keys() and "input_features" in want
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


TOOLS = [{"type": "function", "function": {"name": "zoom", "description": "Zoom into a quadrant.", "parameters": {
    "type": "object", "properties": {"quadrant": {"type": "string"}}, "required": ["quadrant"]}}}]  # fmt: skip


@pytest.mark.parametrize("layout", list(ROWS))
def test_a_pairs_tools_reach_both_sides_as_its_sft_samples_do(media, processor, layout):
    """A pair with a ``tools`` column: both sides render the tool definitions, as the two SFT rows they stand for
    do (ids and labels equal); dropping the column trained on a prompt without them."""
    row = dict(ROWS[layout], tools=TOOLS)
    pairs = PairDataset(qdata.build(_cfg(media, _write(media, [row])), processor).dataset.samples)
    sft = [dict(_sft(r), tools=TOOLS) for r in (GOOD, BAD)]
    reference = qdata.build(qconfig.load(overrides={"data.path": str(_write(media, sft, "sft.jsonl")),
                                                    "data.cache_dir": str(media / "cache"),
                                                    "train.micro_batch_size": 1}), processor).dataset  # fmt: skip
    chosen, rejected = pairs[0]
    chosen.pop("pair_index")
    for got, want in ((chosen, reference[0]), (rejected, reference[1])):
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def test_rejected_images_give_the_rejected_side_its_own_pixels(media, processor):
    row = dict(ROWS["swift"], rejected_images=["img/b.png"])
    chosen, rejected = qdata.build(_cfg(media, _write(media, [row])), processor).dataset[0]
    reference = qdata.build(qconfig.load(overrides={"data.path": str(_write(media, [_sft(BAD, "img/b.png")], "s.jsonl")),
                                                    "data.cache_dir": str(media / "cache"),
                                                    "train.micro_batch_size": 1}), processor).dataset[0]  # fmt: skip
    assert not torch.equal(chosen["image_grid_thw"], rejected["image_grid_thw"])
    for key in reference:
        torch.testing.assert_close(rejected[key], reference[key], rtol=0, atol=0)


def test_images_are_processed_once_per_pair(media, processor, monkeypatch):
    pairs = qdata.build(_cfg(media, _write(media, [ROWS["swift"]])), processor).dataset
    calls = []
    real = processor.image_processor.__class__.__call__
    monkeypatch.setattr(processor.image_processor.__class__, "__call__",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))  # fmt: skip
    chosen, rejected = pairs[0]
    assert len(calls) == 1
    assert rejected["pixel_values"] is chosen["pixel_values"]


@pytest.mark.parametrize(
    "row, detail",
    [
        ({"prompt": Q, "chosen": [{"role": "assistant", "content": GOOD}], "rejected": BAD},
         "a plain (string) prompt takes string replies; 'chosen' is list"),
        ({"prompt": [{"role": "user", "content": Q}], "chosen": [{"role": "user", "content": GOOD}],
          "rejected": [{"role": "assistant", "content": BAD}]}, "'chosen' must end with an assistant message"),
        ({"conversations": [{"from": "human", "value": Q}], "chosen": {"from": "human", "value": GOOD},
          "rejected": {"from": "gpt", "value": BAD}}, "'chosen' must be one reply"),
        ({"messages": [{"role": "user", "content": Q}], "rejected_response": BAD},
         "the last message must be the chosen assistant reply"),
        ({"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": GOOD}], "rejected_response": 3},
         "'rejected_response' must be a string"),
        ({"messages": [{"role": "user", "content": Q}, {"role": "assistant", "content": GOOD}]},
         "no preference layout has the keys"),
    ],
)  # fmt: skip
def test_bad_pairs_are_refused_naming_the_row_and_the_reason(row, detail):
    with pytest.raises(BadSample, match="row 3") as err:
        split_pair(row, Location("pairs.jsonl", row=3))
    assert err.value.reason == "bad_format" and detail in str(err.value)


def test_a_pair_with_one_bad_side_is_dropped_whole_and_named(media, processor):
    rows = [ROWS["swift"], dict(ROWS["swift"], rejected_response=""), ROWS["llamafactory"]]  # row 1: empty rejected
    with pytest.raises(BadSample, match=r"row 1.*empty_reply"):
        qdata.build(_cfg(media, _write(media, rows), **{"data.on_bad_sample": "error"}), processor)
    bundle = qdata.build(_cfg(media, _write(media, rows), **{"data.max_bad_fraction": 0.5}), processor)
    assert len(bundle.dataset) == 2 and bundle.report.skipped == 1


def test_bad_pairs_are_counted_once_as_pairs_and_equal_sides_are_bad(media, processor, capsys):
    """Ten pairs, three bad (a malformed row: both sides; an empty rejected reply: one side; chosen ==
    rejected): 3 of 10 pairs, over a data.max_bad_fraction of 0.2 (counted per side it was 3 of 20, under);
    data check lists each once, and the messages say pairs."""
    from qwenkit.data import check

    good = [dict(ROWS["swift"], messages=[{"role": "user", "content": f"<image>Question {k}?"},
                                          {"role": "assistant", "content": GOOD}]) for k in range(7)]  # fmt: skip
    rows = [*good, {"prompt": Q, "chosen": 3, "rejected": BAD}, dict(ROWS["swift"], rejected_response=""),
            dict(ROWS["trl_plain"], rejected=GOOD)]  # fmt: skip
    path = _write(media, rows)
    with pytest.raises(ValueError, match=r"^3 of 10 pairs \(30\.0%\) are bad, more than data\.max_bad_fraction=0\.2"):
        qdata.build(_cfg(media, path, **{"data.max_bad_fraction": 0.2}), processor)
    bundle = qdata.build(_cfg(media, path, **{"data.max_bad_fraction": 0.3}), processor)
    assert (bundle.report.skipped, bundle.report.total, len(bundle.dataset)) == (3, 10, 7)
    assert bundle.report.by_reason == {"bad_format": 1, "empty_reply": 1, "same_replies": 1}
    with pytest.raises(ValueError, match="the dataset has 7 usable pairs, fewer than one global batch"):
        qdata.build(_cfg(media, path, **{"data.max_bad_fraction": 0.3, "train.micro_batch_size": 8}), processor)
    cfg = _cfg(media, path)
    assert check.check(cfg) == 1
    out = capsys.readouterr().out
    listed = out[out.index("bad pairs:\n"):].splitlines()[1:4]
    assert [line.split(": ")[1:3] for line in listed] == [
        ["row 7 (line 8)", "bad_format"], ["row 8 (line 9)", "empty_reply"], ["row 9 (line 10)", "same_replies"]
    ]  # fmt: skip
    assert "pairs: 7 good, 3 bad, 10 preference rows read" in out and "FAILED: 3 bad pairs" in out
    assert out.count("row 7 (line 8)") == 1


def test_the_sampler_never_splits_a_pair_across_micro_batches_or_ranks(media, processor):
    """Each pair is one sampler index; every rank's micro-batch holds whole pairs (chosen i, rejected P+i)."""
    rows = [dict(ROWS["swift"], messages=[{"role": "user", "content": f"<image>Question {k}?"},
                                          {"role": "assistant", "content": GOOD}]) for k in range(12)]  # fmt: skip
    seen = []
    for rank in range(2):
        cfg = _cfg(media, _write(media, rows), **{"train.micro_batch_size": 3})
        bundle = qdata.build(cfg, processor, rank=rank, world_size=2)
        batches = bundle.batches()
        for _ in range(2):  # one epoch: 12 pairs / (3 x 2 ranks)
            batch = next(batches)
            n = int(batch["num_pairs"])
            assert batch["input_ids"].shape[0] == 2 * n == 6
            for i in range(n):  # the prompts of chosen row i and rejected row n + i are the same
                prompt_c, prompt_r = (batch["input_ids"][j][: int((batch["labels"][j] != -100).nonzero()[0])]
                                      for j in (i, n + i))  # fmt: skip
                assert torch.equal(prompt_c, prompt_r)
                seen.append(tuple(prompt_c.tolist()))
    assert len(seen) == len(set(seen)) == 12  # every pair exactly once over both ranks


def test_pair_collator_counts_pairs_and_chosen_tokens(processor):
    sample = {"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([-100, -100, 3, 4])}
    other = {"input_ids": torch.tensor([1, 2, 5]), "labels": torch.tensor([-100, -100, 5])}
    batch = PairCollator(processor)([(sample, other), (sample, other)])
    assert int(batch["num_pairs"]) == 2 and int(batch["num_chosen_items"]) == 4 and int(batch["num_items"]) == 6


def test_data_check_reports_pairs_layouts_and_refused_rows(tmp_path, tiny_path, capsys):
    from qwenkit.data import check

    Image.new("RGB", (56, 56), "red").save(tmp_path / "a.png")
    rows = [
        {"prompt": "<image>What colour is the shape?", "chosen": "red", "rejected": "blue", "images": ["a.png"]},
        {"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"}],
         "rejected_response": "green", "images": ["a.png"]},
        {"prompt": "x", "chosen": 3, "rejected": "blue"},
        {"foo": 1},
    ]  # fmt: skip
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = qconfig.load(overrides=["train.objective=dpo"])
    cfg.data.path = str(path)
    assert check.check(cfg) == 1
    out = capsys.readouterr().out
    assert "pairs: 2 good, 2 bad, 4 preference rows read" in out and "FAILED: 2 bad pairs" in out
    assert "pair layouts: trl 2, none (refused) 1, swift 1" in out
    assert f"{path}: row 2 (line 3): bad_format: preference row: a plain (string) prompt takes string replies" in out
    assert f"{path}: row 3 (line 4): bad_format: preference row: no preference layout has the keys ['foo']" in out
