"""Audio rows through the data pipeline: the ``audios`` column and ``<audio>`` tags of every layout that has
them, HF's placeholder counts, mixed batches, bad audio in ``qwenkit data check``."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import AUDIO_FAMILY, build_model, tiny_processor, write_png

from qwenkit.cli import main as cli_main
from qwenkit.config import DataConfig
from qwenkit.data import Collator, read_dataset
from qwenkit.data import audio as qaudio
from tests.data.test_audio import write_tone

# one user turn with one audio, in each layout that reads the audios column (LLaMA-Factory's, ms-swift's)
LAYOUT_ROWS = {
    "messages": {"messages": [{"role": "user", "content": "<audio>Which tone?"}, {"role": "assistant", "content": "Low."}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "<audio>Which tone?"}, {"from": "gpt", "value": "Low."}]},
    "alpaca": {"instruction": "<audio>Which tone?", "output": "Low."},
    "swift_query": {"query": "<audio>Which tone?", "response": "Low."},
    "swift_conversation": {"conversation": [{"human": "<audio>Which tone?", "assistant": "Low."}]},
}


def _read(tmp_path, rows, family, **data):
    (tmp_path / "set.json").write_text(json.dumps(rows))
    cfg = DataConfig(path=str(tmp_path / "set.json"), cache_dir=str(tmp_path / "cache"), **data)
    return read_dataset(cfg, tiny_processor(family), use_cache=False)


def _spans(ids: list[int], audio_ids) -> list[int]:
    """Pad tokens of each audio span ``start pad... end`` in ``ids``."""
    start, pad, end = audio_ids
    out, at = [], None
    for k, t in enumerate(ids):
        if t == start:
            at = k
        elif t == end:
            assert all(x == pad for x in ids[at + 1 : k])
            out.append(k - at - 1)
    return out


@AUDIO_FAMILY
@pytest.mark.parametrize("layout", list(LAYOUT_ROWS))
def test_audio_rows_hold_as_many_pads_as_hfs_audio_tower_makes(_cache, tmp_path, family, layout):
    """Each layout's ``<audio>`` becomes the family's span with one pad per feature HF's own audio tower
    makes of the audio (HF scatters the features into the pads without counting them), and the features
    are HF's extractor's, cut to the audio's frames."""
    write_tone(tmp_path / "a.wav", hz=300.0, seconds=0.73)
    write_tone(tmp_path / "b.wav", hz=3000.0, seconds=2.41, channels=1, rate=16_000)
    one = dict(LAYOUT_ROWS[layout], audios=["a.wav"])
    two = json.loads(json.dumps(one).replace("<audio>Which", "<audio> and <audio>Which"))
    two["audios"] = ["b.wav", str(tmp_path / "a.wav")]  # relative and absolute
    dataset, report = _read(tmp_path, [one, two], family)
    assert report.skipped == 0 and len(dataset) == 2
    processor, model = tiny_processor(family), build_model(name=family)
    extractor = qaudio.feature_extractor()
    for i, names in enumerate((["a.wav"], ["b.wav", "a.wav"])):
        sample = dataset[i]
        tower = []
        for k, name in enumerate(names):
            wave = qaudio.decode(name, None, tmp_path)
            ref = extractor(wave, sampling_rate=16_000, return_attention_mask=True, padding="max_length",
                            return_tensors="pt")  # fmt: skip  # as Qwen-Omni's processors call it
            frames = int(ref["attention_mask"].sum())
            torch.testing.assert_close(sample["input_features"][k, :, :frames], ref["input_features"][0, :, :frames])
            assert sample["feature_attention_mask"][k].sum() == frames
            with torch.no_grad():
                out = model.model.get_audio_features(ref["input_features"][:, :, :frames],
                                                     feature_attention_mask=ref["attention_mask"][:, :frames],
                                                     return_dict=True)  # fmt: skip
            tower.append(out.last_hidden_state.shape[0])
        assert _spans(sample["input_ids"].tolist(), processor.audio_ids) == tower


@AUDIO_FAMILY
def test_a_batch_mixing_audio_image_and_text_rows_has_the_loss_of_its_rows_one_at_a_time(_cache, tmp_path, family):
    """Rows with and without audio (and with and without images), in one padded micro-batch (audio features
    padded to the longest audio), give the sum of the rows' losses taken alone over the same token count. The
    router's aux loss is left out: it balances experts over the whole batch, so it is no sum over rows."""
    write_tone(tmp_path / "a.wav", hz=300.0, seconds=0.6)
    write_tone(tmp_path / "b.wav", hz=2000.0, seconds=1.7)
    write_png(tmp_path / "i.png", (56, 84))
    rows = [
        {"messages": [{"role": "user", "content": "<audio>Which?"}, {"role": "assistant", "content": "Low."}], "audios": ["a.wav"]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "They are red."}]},
        {"messages": [{"role": "user", "content": "<image><audio>Both?"}, {"role": "assistant", "content": "A circle."}],
         "images": ["i.png"], "audios": ["b.wav"]},
        {"messages": [{"role": "user", "content": "<image>Shape?"}, {"role": "assistant", "content": "A square."}], "images": ["i.png"]},
        {"conversations": [{"from": "human", "value": "<audio><audio>Two?"}, {"from": "gpt", "value": "High."}], "audios": ["b.wav", "a.wav"]},
    ]  # fmt: skip
    dataset, _ = _read(tmp_path, rows, family)
    collate = Collator(tiny_processor(family))
    model = build_model(chunk=True, seed=3, name=family)
    batch = collate([dataset[i] for i in range(len(rows))])
    assert batch["input_features"].shape[0] == 4 and "pixel_values" in batch
    total = batch.pop("num_items")
    batch.pop("num_samples")
    with torch.no_grad():
        mixed = model(**batch, num_items_in_batch=total, output_router_logits=False).loss
        alone = []
        for i in range(len(rows)):
            one = collate([dataset[i]])
            one.pop("num_samples"), one.pop("num_items")
            alone.append(model(**one, num_items_in_batch=total, output_router_logits=False).loss)
    torch.testing.assert_close(mixed, torch.stack(alone).sum(), rtol=1e-5, atol=1e-6)  # fp32 sums in another order


def test_a_family_without_an_audio_tower_names_the_row_with_audio(tmp_path):
    write_tone(tmp_path / "a.wav")
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo."}]},
            dict(LAYOUT_ROWS["sharegpt"], audios=["a.wav"])]  # fmt: skip
    dataset, report = _read(tmp_path, rows, "qwen2_5_vl")
    assert len(dataset) == 1 and report.by_reason == {"no_audio_tower": 1}
    bad = dataset.index.bad[0]
    assert bad.file.endswith("set.json") and bad.row == 1 and "qwen2_5_vl has no audio tower" in bad.detail


def test_placeholders_and_audios_must_agree(tmp_path):
    write_tone(tmp_path / "a.wav")
    rows = [dict(LAYOUT_ROWS["alpaca"], audios=["a.wav", "a.wav"]), dict(LAYOUT_ROWS["alpaca"], instruction="Which?", audios=["a.wav"])]
    _, report = _read(tmp_path, rows, "qwen3_omni_moe")
    assert report.by_reason == {"audio_count": 2}


def test_data_check_counts_and_names_bad_audio_in_a_llama_factory_file(tmp_path, capsys):
    """``qwenkit data check`` on a sharegpt / alpaca file with ``audios``: the good rows' audio counted, each
    bad audio named by file, row and reason, exit 1."""
    write_tone(tmp_path / "a.wav", seconds=1.0)
    (tmp_path / "bad.wav").write_bytes(b"RIFF not a wave")
    write_tone(tmp_path / "long.wav", seconds=31.0, channels=1, rate=16_000)
    rows = [
        dict(LAYOUT_ROWS["sharegpt"], audios=["a.wav"]),
        dict(LAYOUT_ROWS["alpaca"], audios=["gone.wav"]),
        dict(LAYOUT_ROWS["sharegpt"], audios=["bad.wav"]),
        dict(LAYOUT_ROWS["alpaca"], audios=["long.wav"]),
        dict(LAYOUT_ROWS["alpaca"], audios=["data:audio/wav;base64,%%%"]),
    ]
    path = tmp_path / "set.json"
    path.write_text(json.dumps(rows))
    code = cli_main(["data", "check", str(path), "model.name=qwen3_omni_moe", f"data.cache_dir={tmp_path / 'c'}"])
    out = capsys.readouterr().out
    assert code == 1
    assert "audios: 1, 1.0 s, 13 tokens" in out  # 100 mel frames: one full window of 13 tokens (Qwen3-Omni)
    for row, reason in ((1, "missing_audio"), (2, "corrupt_audio"), (3, "long_audio"), (4, "corrupt_audio")):
        assert any(f"set.json: row {row}" in line and reason in line for line in out.splitlines()), (row, reason, out)


def test_audio_in_video_is_refused_by_the_scan_too(tmp_path):
    """The config check refuses ``data.use_audio_in_video=true`` (tests/config/test_data.py); a ``DataConfig``
    made in code, which no check has seen, is refused by the scan instead of training without the audio."""
    with pytest.raises(ValueError, match="use_audio_in_video=true"):
        _read(tmp_path, [LAYOUT_ROWS["messages"]], "qwen2_5_omni", use_audio_in_video=True)


@pytest.mark.parametrize("on_bad, fraction, raised", [("skip", 0.5, None), ("skip", 0.2, "max_bad_fraction"),
                                                      ("error", 1.0, "missing_audio")])  # fmt: skip
def test_bad_audio_rows_follow_the_bad_row_rules(tmp_path, on_bad, fraction, raised):
    """One row of three with a missing audio: skipped within data.max_bad_fraction, refused beyond it, and the
    first bad row itself with data.on_bad_sample=error, named by file and row."""
    from qwenkit.data.load import read_checked

    write_tone(tmp_path / "a.wav")
    rows = [dict(LAYOUT_ROWS["sharegpt"], audios=["a.wav"]), dict(LAYOUT_ROWS["alpaca"], audios=["gone.wav"]),
            dict(LAYOUT_ROWS["messages"], audios=["a.wav"])]  # fmt: skip
    (tmp_path / "set.json").write_text(json.dumps(rows))
    cfg = DataConfig(path=str(tmp_path / "set.json"), cache_dir=str(tmp_path / "c"), on_bad_sample=on_bad,
                     max_bad_fraction=fraction)  # fmt: skip
    if raised is None:
        dataset, report = read_checked(cfg, tiny_processor("qwen2_5_omni"))
        assert len(dataset) == 2 and report.by_reason == {"missing_audio": 1}
        return
    with pytest.raises(Exception, match=raised) as caught:
        read_checked(cfg, tiny_processor("qwen2_5_omni"))
    assert on_bad == "skip" or "set.json: row 1" in str(caught.value)


def test_a_layout_without_audio_refuses_an_audios_column_instead_of_dropping_it():
    from qwenkit.data.conversation import parse_row
    from qwenkit.data.report import BadSample, Location

    row = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo."}], "image": "a.png",
           "audios": ["a.wav"]}  # fmt: skip
    with pytest.raises(BadSample, match=r"the row has 'audios', but layout llava \(detected\) takes media from 'image' "
                                        r"and 'video'; its 'audios' would be dropped"):  # fmt: skip
        parse_row(row, Location("set.json", row=0))
