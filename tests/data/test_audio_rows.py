"""Audio rows through the data pipeline: the ``audios`` column and ``<audio>`` tags of every layout that has
them, HF's placeholder counts, mixed batches, bad audio in ``qwenkit data check``, and videos heard with their
own audio track (``data.use_audio_in_video``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import AUDIO_FAMILY, build_model, tiny_processor, write_png

from qwenkit.cli import main as cli_main
from qwenkit.config import DataConfig
from qwenkit.data import Collator, read_dataset
from qwenkit.data import audio as qaudio
from tests.data.test_audio import write_tone
from tests.videos import LOSSLESS, write_heard_video, write_video

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
    """Each layout's ``<audio>`` becomes the family's span with one pad per feature HF's own audio tower makes
    of the sample's features (HF scatters the features into the pads without counting them); the features
    themselves are HF's processor's (:func:`test_token_ids_and_features_equal_hfs_omni_processor`)."""
    write_tone(tmp_path / "a.wav", hz=300.0, seconds=0.73)
    write_tone(tmp_path / "b.wav", hz=3000.0, seconds=2.41, channels=1, rate=16_000)
    one = dict(LAYOUT_ROWS[layout], audios=["a.wav"])
    two = json.loads(json.dumps(one).replace("<audio>Which", "<audio> and <audio>Which"))
    two["audios"] = ["b.wav", str(tmp_path / "a.wav")]  # relative and absolute
    dataset, report = _read(tmp_path, [one, two], family)
    assert report.skipped == 0 and len(dataset) == 2
    processor, model = tiny_processor(family), build_model(name=family)
    for i, count in enumerate((1, 2)):
        sample = dataset[i]
        tower = []
        for k in range(count):
            frames = int(sample["feature_attention_mask"][k].sum())
            with torch.no_grad():
                out = model.model.get_audio_features(sample["input_features"][k : k + 1, :, :frames],
                                                     feature_attention_mask=torch.ones(1, frames, dtype=torch.long),
                                                     return_dict=True)  # fmt: skip
            tower.append(out.last_hidden_state.shape[0])
        assert _spans(sample["input_ids"].tolist(), processor.audio_ids) == tower


def _hf_processor(family: str):
    """HF's own ``Qwen2_5OmniProcessor`` / ``Qwen3OmniMoeProcessor`` over the tiny checkpoint's tokenizer, image
    processor and the Omni feature extractor. Its ``__init__`` wants a video processor, which needs torchvision
    (not installed here: docs/DESIGN's CUDA-linked wheel); the attributes it sets are set by hand instead, so
    ``__call__`` (the placeholder expansion, the features) is HF's code unchanged."""
    import transformers

    processor = tiny_processor(family)
    cls = {"qwen2_5_omni": transformers.Qwen2_5OmniProcessor, "qwen3_omni_moe": transformers.Qwen3OmniMoeProcessor}[family]
    hf = cls.__new__(cls)
    hf.tokenizer, hf.image_processor, hf.video_processor = processor.tokenizer, processor.image_processor, None
    hf.feature_extractor, hf.chat_template = qaudio.feature_extractor(), None
    start, pad, end = processor.tokenizer.convert_ids_to_tokens(list(processor.audio_ids))
    hf.image_token, hf.video_token, hf.audio_token, hf.audio_bos_token, hf.audio_eos_token = (
        "<|image_pad|>", "<|video_pad|>", pad, start, end)  # fmt: skip
    hf.vision_bos_token, hf.vision_eos_token = "<|vision_start|>", "<|vision_end|>"
    hf.image_token_id, hf.video_token_id, hf.audio_token_id = processor.image_token_id, processor.video_token_id, processor.audio_ids[1]
    return hf, (start, pad, end)


@AUDIO_FAMILY
def test_token_ids_and_features_equal_hfs_omni_processor(_cache, tmp_path, family):
    """A row with an image and two audios of other lengths, neither a whole number of 10 ms hops: qwenkit's ids
    equal HF's Omni processor's on the text the family's chat template writes (each ``<audio>`` as the
    unexpanded span HF's templates write), and its features and mask equal the processor's up to each audio's
    frames. HF pads Qwen2.5-Omni's audios to 30 s, Qwen3-Omni's to the row's longest, which then keeps one
    frame fewer (242 -> 241 here) and reflects its own end in its last frame."""
    from PIL import Image

    write_tone(tmp_path / "a.wav", hz=300.0, seconds=0.7317, channels=1, rate=16_000)  # 11707 samples
    write_tone(tmp_path / "b.wav", hz=3000.0, seconds=2.4111, channels=1, rate=16_000)  # 38577 samples
    write_png(tmp_path / "i.png", (84, 56))
    user, reply = "<image>Look<audio>and<audio>Which tone is higher?", "The second."
    row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
           "images": ["i.png"], "audios": ["b.wav", "a.wav"]}  # fmt: skip
    dataset, _ = _read(tmp_path, [row], family)
    sample = dataset[0]
    hf, (start, pad, end) = _hf_processor(family)
    parts = [{"type": "image"}, {"type": "text", "text": "LookAUDIOandAUDIOWhich tone is higher?"}]
    text = tiny_processor(family).tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text", "text": reply}]}],
        tokenize=False,
    ).replace("AUDIO", start + pad + end)
    waves = [qaudio.decode(name, None, tmp_path) for name in ("b.wav", "a.wav")]
    out = hf(text=[text], images=[Image.open(tmp_path / "i.png")], audio=waves, return_tensors="pt")
    assert sample["input_ids"].tolist() == out["input_ids"][0].tolist()
    torch.testing.assert_close(sample["image_grid_thw"], out["image_grid_thw"])
    for k, frames in enumerate(sample["feature_attention_mask"].sum(1).tolist()):
        assert int(out["feature_attention_mask"][k].sum()) == frames
        torch.testing.assert_close(sample["input_features"][k, :, :frames], out["input_features"][k, :, :frames])


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


# a row hearing a video (5 s: three of Qwen2.5-Omni's 2-s chunks) before a standalone audio
HEARD_ROW = {"messages": [{"role": "user", "content": "<video>What is heard?<audio>And here?"},
                          {"role": "assistant", "content": "A tone, then a lower one."}],
             "videos": ["v.mkv"], "audios": ["a.wav"]}  # fmt: skip


def write_heard_set(tmp_path, rows=(HEARD_ROW,)):
    """``v.mkv`` (50 lossless frames at 10 fps, sampled at data.video_fps=2: 1 s per temporal patch, with a 5-s
    880 Hz track), ``a.wav`` (1.3 s at 300 Hz) and the rows."""
    write_heard_video(tmp_path / "v.mkv", 64, 48, frames=50, fps=10, hz=880.0)
    write_tone(tmp_path / "a.wav", hz=300.0, seconds=1.3, channels=1, rate=16_000)
    return list(rows)


class _Frames:
    """A stand-in for HF's video processor (its class needs torchvision, not installed here): the pixels and grid
    qwenkit made of the video's sampled frames (tests/data/test_video.py checks those against a reference), and
    the two attributes HF's processor reads; HF's own code does the rest (the span, the audio, the order)."""

    def __init__(self, sample, processor):
        self.sample, self.merge_size, self.temporal_patch_size = sample, processor.merge_size, 2

    def __call__(self, videos, **kwargs):
        return {"pixel_values_videos": self.sample["pixel_values_videos"], "video_grid_thw": self.sample["video_grid_thw"]}


@AUDIO_FAMILY
def test_a_heard_video_equals_hfs_omni_processor_with_load_audio_from_video(_cache, tmp_path, family):
    """``data.use_audio_in_video``: a row with a video carrying an audio track, then a standalone audio. Its ids
    equal HF's Omni processor's called with ``load_audio_from_video=True`` on the same frames and waveforms
    (the track given per slot, ``audio_from_video_indices=[0, None]``, as vLLM passes it: torchcodec, which HF
    decodes tracks with, is not installed): the video's span is HF's interleaving (Qwen2.5-Omni: per 2-s chunk
    the chunk's video pads then its audio pads; Qwen3-Omni: merged by time), and the features, masks and
    ``video_second_per_grid`` are HF's, the track's first (placeholder order)."""
    rows = write_heard_set(tmp_path)
    dataset, report = _read(tmp_path, rows, family, use_audio_in_video=True)
    assert report.skipped == 0
    sample = dataset[0]
    hf, (start, pad, end) = _hf_processor(family)
    hf.video_processor = _Frames(sample, tiny_processor(family))
    turns = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What is heard?AUDIOAnd here?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": rows[0]["messages"][1]["content"]}]}]  # fmt: skip
    text = tiny_processor(family).tokenizer.apply_chat_template(turns, tokenize=False).replace("AUDIO", start + pad + end)
    waves = [qaudio.decode(str(tmp_path / "v.mkv"), None), qaudio.decode("a.wav", None, tmp_path)]
    frames = np.zeros((10, 48, 64, 3), np.uint8)  # the stand-in gives qwenkit's pixels of the sampled frames
    out = hf(text=[text], videos=[frames], audio=waves, audio_from_video_indices=[0, None], load_audio_from_video=True,
             fps=2.0, return_tensors="pt")  # fmt: skip
    ids = sample["input_ids"]
    assert ids.tolist() == out["input_ids"][0].tolist()
    assert int((ids == tiny_processor(family).video_token_id).sum()) == int(sample["video_grid_thw"].prod()) // 4
    torch.testing.assert_close(sample["pixel_values_videos"], out["pixel_values_videos"])
    torch.testing.assert_close(sample["second_per_grid_ts"], out["video_second_per_grid"].float())
    assert sample["feature_attention_mask"].sum(1).tolist() == out["feature_attention_mask"].sum(1).tolist()
    for k, frames in enumerate(sample["feature_attention_mask"].sum(1).tolist()):
        torch.testing.assert_close(sample["input_features"][k, :, :frames], out["input_features"][k, :, :frames])
    assert sample["feature_attention_mask"][0].sum() == 500  # the 5-s track first, as its span comes first


@AUDIO_FAMILY
def test_a_silent_or_undecodable_video_is_a_bad_row_by_file_and_row(_cache, tmp_path, family):
    """With ``data.use_audio_in_video`` a video without an audio track is a bad row (``silent_video``): HF's
    processor gives it a plain video span, but its ``get_rope_index`` under ``use_audio_in_video`` (one flag per
    batch) places only heard videos, so the frames would get text positions; a track that does not decode is
    ``corrupt_audio``; both named by file and row. Without the setting the same rows are good."""
    rows = write_heard_set(tmp_path)
    write_video(tmp_path / "silent.mkv", 64, 48, 20, 10, codec=LOSSLESS)
    write_heard_video(tmp_path / "garbage.mkv", 64, 48, frames=20, fps=10, garbage=True)
    rows += [dict(HEARD_ROW, videos=["silent.mkv"]), dict(HEARD_ROW, videos=["garbage.mkv"])]
    dataset, report = _read(tmp_path, rows, family, use_audio_in_video=True)
    assert len(dataset) == 1 and report.by_reason == {"silent_video": 1, "corrupt_audio": 1}
    bad = {b.row: b for b in dataset.index.bad}
    assert bad[1].file.endswith("set.json") and "video 0 of 1 ('silent.mkv')" in bad[1].detail
    assert "no audio track" in bad[1].detail and "video 0 of 1 ('garbage.mkv'): cannot decode" in bad[2].detail
    heard_off, report = _read(tmp_path, rows, family)
    assert len(heard_off) == 3 and report.skipped == 0


@AUDIO_FAMILY
def test_data_check_with_audio_in_video_names_a_video_whose_audio_does_not_decode(_cache, tmp_path, capsys, family):
    """``qwenkit data check ... data.use_audio_in_video=true``: the heard video's track counted with the audios,
    the video whose track does not decode named by file, row and reason, exit 1."""
    rows = write_heard_set(tmp_path)
    write_heard_video(tmp_path / "garbage.mkv", 64, 48, frames=20, fps=10, garbage=True)
    path = tmp_path / "set.json"
    path.write_text(json.dumps([*rows, dict(HEARD_ROW, videos=["garbage.mkv"])]))
    code = cli_main(["data", "check", str(path), f"model.name={family}", "data.use_audio_in_video=true",
                     f"data.cache_dir={tmp_path / 'c'}"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert "audios: 2, 6.3 s" in out  # the 5-s track and the 1.3-s audio of the good row
    bad = [line for line in out.splitlines() if "set.json: row 1" in line]
    assert bad and "corrupt_audio" in bad[0] and "video 0 of 1 ('garbage.mkv'): cannot decode" in bad[0], out


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
