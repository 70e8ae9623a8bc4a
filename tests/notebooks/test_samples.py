"""Notebook 01's data view: token runs by kind, rendered samples, bad-sample tables, saved metrics."""

import json
from pathlib import Path

import pytest
from PIL import Image

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.data.check import percentiles
from qwenkit.model.paths import load_processor
from qwenkit.notebooks import samples

MLLM_DEMO = Path(__file__).resolve().parents[3] / "shared" / "data" / "mllm_demo" / "mllm_demo.json"


def test_segments_group_tokens_by_what_the_loss_does_with_them(processor):
    tok = processor.tokenizer
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    reply = tok.encode("They are red.", add_special_tokens=False)
    ids = [im_start, processor.vision_start_id] + [processor.image_token_id] * 4 + [processor.vision_end_id]
    ids += reply + [im_end]
    labels = [-100] * 7 + reply + [im_end]
    segs = samples.segments(ids, labels, processor)
    assert segs == [
        ("special", "<|im_start|>"), ("special", "<|vision_start|>"), ("image", "4"), ("special", "<|vision_end|>"),
        ("learned", "They are red.<|im_end|>"),
    ]


@pytest.fixture
def bad_dataset(tmp_path):
    Image.new("RGB", (64, 64), (200, 0, 0)).save(tmp_path / "ok.png")
    rows = [
        {"messages": [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "Red."}],
         "images": ["ok.png"]},
        {"messages": [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "Hello."}],
         "images": ["missing.png"]},
        {"messages": [{"role": "robot", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
    ]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows))
    return path


def test_bad_samples_tables_and_metrics(tmp_path, bad_dataset, tiny_path):
    cfg = qconfig.load(overrides={"data.path": str(bad_dataset)})
    processor = load_processor(cfg)
    dataset, report = data.read_dataset(cfg.data, processor)
    html = samples.render_sample(dataset, 0)
    assert "data:image/png;base64," in html and "Red." in html and "&lt;image: " in html
    values = samples.save(tmp_path / "out", str(bad_dataset), dataset, report, max_length=1024)
    assert (values["good"], values["bad"], values["rows"]) == (1, 2, 3)
    doc = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert doc["passed"] and "1 good / 2 bad of 3 rows" in doc["summary"]
    # the tables are drawn from data_summary.csv alone
    by_reason, messages = (f.data[0].cells.values for f in samples.bad_sample_figures(tmp_path / "out"))
    assert set(by_reason[0]) == {"missing_image", "bad_role"}
    assert len(messages[1]) == 2 and all("d.json: row" in m for m in messages[1])
    dist = samples.distributions(dataset)
    tokens, image_tokens, learned = samples.distribution_figures(tmp_path / "out")
    assert [list(f.data[0].x) for f in (tokens, image_tokens, learned)] == [
        dist["tokens"], dist["image_tokens"], dist["learned_tokens"]
    ]


def test_distributions_of_the_tiny_set(tiny_path):
    cfg = qconfig.load(overrides={"data.tiny_samples": 6})
    dataset, _ = data.read_dataset(cfg.data, load_processor(cfg))
    dist = samples.distributions(dataset)
    assert dist["image_tokens"] == [16] * 6 and dist["images"] == [1] * 6
    assert all(t > img + learned for t, img, learned in zip(dist["tokens"], dist["image_tokens"], dist["learned_tokens"]))
    p = percentiles(dist["tokens"])
    assert p["min"] <= p["p50"] <= p["max"]


@pytest.mark.skipif(not MLLM_DEMO.is_file(), reason=f"{MLLM_DEMO} is not here (a sibling of this checkout)")
def test_mllm_demo_renders_multi_turn_and_cjk(tiny_path):
    cfg = qconfig.load(overrides={"data.path": str(MLLM_DEMO), "data.max_length": 2048})
    dataset, report = data.read_dataset(cfg.data, load_processor(cfg))
    assert len(dataset) == 6 and report.skipped == 0
    pages = [samples.render_sample(dataset, i) for i in range(len(dataset))]
    assert all(p.count("<img ") >= 1 for p in pages)
    assert any("\ufffd" not in p and any("\u4e00" <= ch <= "\u9fff" for ch in p) for p in pages)  # CJK decoded whole


def test_video_sample_renders_frames_and_token_counts(tmp_path, tiny_path):
    pytest.importorskip("av")
    from videos import write_video

    write_video(tmp_path / "clip.avi", 96, 72, 30, 10)  # 3 s at 10 fps: 6 frames sampled at 2 fps
    rows = [{"messages": [{"role": "user", "content": "<video>What moves?"}, {"role": "assistant", "content": "A square."}],
             "videos": ["clip.avi"]}]  # fmt: skip
    (tmp_path / "d.json").write_text(json.dumps(rows))
    cfg = qconfig.load(overrides={"data.path": str(tmp_path / "d.json")})
    dataset, report = data.read_dataset(cfg.data, load_processor(cfg))
    grid = dataset.samples[0].video_grids[0]
    tokens = dataset.processor.image_tokens(grid)
    assert grid[0] == 3 and samples.distributions(dataset)["video_tokens"] == [tokens]
    page = samples.render_sample(dataset, 0)
    assert f"&lt;video: {tokens} tokens&gt;" in page and f"{tokens} tokens (3 x {tokens // 3})" in page
    assert page.count("<figure") == 4 and "frame 0 · 0.0 s" in page and "frame 29 · 2.9 s" in page
    values = samples.save(tmp_path / "out", str(tmp_path / "d.json"), dataset, report, max_length=1024)
    assert (values["videos"], values["video_tokens_total"]) == (1, tokens)


def test_padding_of_an_epoch_padded_vs_packed():
    lengths = [10, 30, 20, 40, 5, 5, 50, 10]
    rows = samples.padding(lengths, micro_batch_size=4, seed=0)
    batches = data.FixedSizeSampler(len(lengths), 4, seed=0).epoch_batches(0)
    padded = sum(4 * max(lengths[i] for i in b) for b in batches)
    assert rows[0]["positions"] == padded and rows[0]["micro-batches"] == 2
    assert rows[0]["padding fraction"] == pytest.approx(1 - sum(lengths) / padded)
    assert rows[1]["positions"] == sum(lengths) and rows[1]["padding fraction"] == 0.0


def test_audio_rows_show_a_player_and_their_token_counts(tmp_path, _cache):
    """The tone task on the tiny Qwen3-Omni thinker: each audio a playable WAV with its seconds and tokens (the
    index's, which the token stream's chip shows too), and the audio tokens counted per sample and in total."""
    cfg = qconfig.load(overrides={"data.tiny_task": "tones", "data.tiny_samples": 3, "model.name": "qwen3_omni_moe",
                                  "data.cache_dir": str(tmp_path / "c")})  # fmt: skip
    dataset, report = data.read_dataset(cfg.data, load_processor(cfg))
    (_, tokens, _), = dataset.index.grids(0, "audio")
    page = samples.render_sample(dataset, 0)
    assert page.count("<audio controls src=\"data:audio/wav;base64,") == 1
    assert f"{tokens} tokens</div>" not in page and f", {tokens} tokens<br>" in page and f"&lt;audio: {tokens} tokens&gt;" in page
    dist = samples.distributions(dataset)
    assert dist["audios"] == [1, 1, 1] and dist["audio_tokens"][0] == tokens and dist["image_tokens"] == [0, 0, 0]
    values = samples.save(tmp_path / "out", "tiny", dataset, report, max_length=1024)
    assert values["audios"] == 3 and values["audio_tokens_total"] == sum(dist["audio_tokens"])
    titles = [f.layout.title.text for f in samples.distribution_figures(tmp_path / "out")]
    assert "Audio tokens per sample" in titles


def test_a_heard_video_shows_its_track_beside_the_audios(tmp_path, _cache):
    """``data.use_audio_in_video``: the player list follows the order the thinker hears (the video's track first,
    then the ``<audio>``), each with its own token count; the page renders the interleaved span."""
    from tests.data.test_audio_rows import write_heard_set

    rows = write_heard_set(tmp_path)
    (tmp_path / "d.json").write_text(json.dumps(rows))
    cfg = qconfig.load(overrides={"data.path": str(tmp_path / "d.json"), "model.name": "qwen2_5_omni",
                                  "data.use_audio_in_video": True, "data.cache_dir": str(tmp_path / "c")})  # fmt: skip
    dataset, report = data.read_dataset(cfg.data, load_processor(cfg))
    (_, track, _), (_, tone, _) = dataset.index.grids(0, "audio")
    page = samples.render_sample(dataset, 0)
    assert page.count("<audio controls src=\"data:audio/wav;base64,") == 2
    assert page.index(f"the track of video 0: 5.00 s, {track} tokens") < page.index(f"audio 0: 1.30 s, {tone} tokens")
