"""Dataset layouts (qwenkit.data.layouts): each public layout, written from its own spec with our
own texts and images, reads to the same tokens, labels and pixels as the same conversation in
today's ``messages`` layout; typed parts also equal HF's Qwen2.5-VL chat template; bad rows of
each layout are named by file and row; detection on mixed files; data check and 2-step training
through the CLI for every layout. Also #22's transparent images, invisible replies and images
replaced after the index was built."""

from __future__ import annotations

import base64
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import make_cfg, write_png
from PIL import Image

from qwenkit import config as qconfig
from qwenkit.cli import main as cli_main
from qwenkit.data import BadSample, layouts, read_dataset
from qwenkit.data.images import MediaRef, load
from qwenkit.data.video import VideoMeta, probe
from qwenkit.engine.run import events

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def media(tmp_path):
    """Two images under tmp_path/img (relative names a.png / b.png from the data file's dir)."""
    write_png(tmp_path / "img" / "a.png", (64, 48), (200, 30, 30))
    write_png(tmp_path / "img" / "b.png", (40, 90), (30, 30, 200))
    return tmp_path


A, B = "img/a.png", "img/b.png"
TWO_TURNS = [("<image>What colour is this box?", "Red."), ("And this one?<image>", "Blue.")]


def messages_row(turns, images=(), system=None, videos=()):
    """Today's layout: the reference every other layout must read to."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})
    ]
    row = {"messages": msgs, "images": list(images)}
    if videos:
        row["videos"] = list(videos)
    return row


def data_uri(path: Path) -> str:
    data = path.read_bytes() if path.is_file() else b""  # (collection lists the cases before any image exists)
    return "data:image/png;base64," + base64.b64encode(data).decode()


def cases(root: Path) -> dict[str, tuple[str, dict, dict]]:
    """layout name -> (expected detected layout, the row as the layout's spec writes it, the same in messages)."""
    return {
        # LLaVA-1.5 / ShareGPT4V: singular image string, <image>\n first, from human/gpt
        "llava": ("llava", {"id": "llava-1", "image": A, "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is this box?"}, {"from": "gpt", "value": "Red."}]},
            messages_row([("<image>\nWhat colour is this box?", "Red.")], [A])),
        # InternVL jsonl / qwen-vl-finetune: image as a list, width/height, several turns
        "llava_list": ("llava", {"image": [A, B], "width": 64, "height": 48, "conversations": [
            {"from": "human", "value": TWO_TURNS[0][0]}, {"from": "gpt", "value": "Red."},
            {"from": "human", "value": TWO_TURNS[1][0]}, {"from": "gpt", "value": "Blue."}]},
            messages_row(TWO_TURNS, [A, B])),
        "llava_text_only": ("sharegpt", {"conversations": [
            {"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]},
            messages_row([("Say hi.", "Hi.")])),
        "sharegpt": ("sharegpt", {"system": "Answer briefly.", "conversations": [
            {"from": "human", "value": TWO_TURNS[0][0]}, {"from": "gpt", "value": "Red."},
            {"from": "human", "value": TWO_TURNS[1][0]}, {"from": "gpt", "value": "Blue."}], "images": [A, B]},
            messages_row(TWO_TURNS, [A, B], system="Answer briefly.")),
        # TRL / HuggingFaceH4 llava-instruct-mix-vsft: bare image parts take the images column
        "typed_trl": ("typed", {"messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this box?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
            {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}], "images": [A, B]},
            messages_row(TWO_TURNS, [A, B])),
        # qwen-vl-utils: inline sources (file:// and a plain path), string and list contents mixed
        "typed_qwen_vl_utils": ("typed", {"messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "image", "image": f"file://{root / A}"},
                                         {"type": "text", "text": "What colour is this box?"}]},
            {"role": "assistant", "content": "Red."},
            {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image", "image": B}]},
            {"role": "assistant", "content": "Blue."}]},
            messages_row(TWO_TURNS, [str(root / A), B], system="Answer briefly.")),
        # OpenAI: image_url parts with a data URI
        "typed_openai": ("typed", {"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(root / A)}},
                                         {"type": "text", "text": "What colour is this box?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Red."}]}]},
            messages_row([TWO_TURNS[0]], [data_uri(root / A)])),
        # LLaMA-Factory v1: {"type", "value"} parts and loss_weight
        "typed_llamafactory_v1": ("typed", {"messages": [
            {"role": "user", "content": [{"type": "image_url", "value": A},
                                         {"type": "text", "value": "What colour is this box?"}], "loss_weight": 0.0},
            {"role": "assistant", "content": [{"type": "text", "value": "Red."}], "loss_weight": 1.0}]},
            messages_row([TWO_TURNS[0]], [A])),
        # Qwen-VL (v1): <img>path</img> tags, read as images where they stand
        "qwen_vl": ("qwen_vl", {"conversations": [
            {"from": "user", "value": f"Picture 1: <img>{A}</img>\nWhat colour is this box?"},
            {"from": "assistant", "value": "Red."}]},
            messages_row([("Picture 1: <image>\nWhat colour is this box?", "Red.")], [A])),
        "swift_conversation": ("swift_conversation", {"system": "Answer briefly.", "conversation": [
            {"human": TWO_TURNS[0][0], "assistant": "Red."}, {"human": TWO_TURNS[1][0], "assistant": "Blue."}],
            "images": [A, B]}, messages_row(TWO_TURNS, [A, B], system="Answer briefly.")),
        "swift_query": ("swift_query", {"system": "Answer briefly.", "query": TWO_TURNS[1][0], "response": "Blue.",
            "history": [[TWO_TURNS[0][0], "Red."]], "images": [A, B]},
            messages_row(TWO_TURNS, [A, B], system="Answer briefly.")),
        # LLaMA-Factory alpaca: instruction and input joined by a newline
        "alpaca": ("alpaca", {"instruction": "<image>What colour is this box?", "input": "One word.",
            "output": "Red.", "images": [A]}, messages_row([("<image>What colour is this box?\nOne word.", "Red.")], [A])),
        # the_cauldron: no placeholders, the images before the first user turn
        "cauldron": ("cauldron", {"images": [A, B], "texts": [
            {"user": "Which colours?", "assistant": "Red and blue.", "source": "ours"},
            {"user": "Sure?", "assistant": "Yes."}]},
            messages_row([("<image><image>Which colours?", "Red and blue."), ("Sure?", "Yes.")], [A, B])),
    }  # fmt: skip


CASES = list(cases(Path("/")))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def samples(path, processor, **data):
    dataset, report = read_dataset(make_cfg(path=str(path), shuffle=False, **data).data, processor, use_cache=False)
    assert report.skipped == 0, report.messages
    return dataset


def assert_same(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


@pytest.mark.parametrize("name", CASES)
def test_each_layout_reads_as_the_same_messages_row(media, processor, name):
    expected_layout, row, reference = cases(media)[name]
    got = samples(write_jsonl(media / "layout.jsonl", [row]), processor)
    want = samples(write_jsonl(media / "messages.jsonl", [reference]), processor)
    assert got.conversation(0).layout == expected_layout
    assert want.conversation(0).layout == "messages"
    assert_same(got, want)  # input_ids, labels, pixel_values, grids
    assert len(got.image_refs(0)) == len(reference["images"])
    # forcing the detected layout reads the same
    assert_same(samples(media / "layout.jsonl", processor, layout=expected_layout), want)


def test_layout_names_are_the_configs():
    assert qconfig.DATA_LAYOUTS == layouts.NAMES


def hf_ids(processor, messages, dataset, i=0):
    """HF's chat template on the typed messages, each pad expanded as Qwen2VLProcessor does."""
    clean = [
        {**m, "content": [{k: v for k, v in p.items() if v is not None} for p in m["content"]]}
        if isinstance(m["content"], list) else m
        for m in messages
    ]  # fmt: skip
    text = processor.tokenizer.apply_chat_template(clean, tokenize=False)
    grids = iter(dataset.index.grids(i))
    pieces = re.split(r"(<\|image_pad\|>)", text)
    text = "".join(p * processor.image_tokens(next(grids)) if k % 2 else p for k, p in enumerate(pieces))
    return processor.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["typed_trl", "typed_qwen_vl_utils", "typed_openai"])
def test_typed_parts_equal_hf_chat_template(media, processor, name):
    _, row, _ = cases(media)[name]
    dataset = samples(write_jsonl(media / "t.jsonl", [row]), processor)
    assert dataset[0]["input_ids"].tolist() == hf_ids(processor, row["messages"], dataset)


def test_typed_parts_from_parquet_with_an_image_column(media, processor):
    """TRL's parquet: content parts are Arrow structs (every field, None where absent), images an Image sequence."""
    datasets = pytest.importorskip("datasets")
    _, row, reference = cases(media)["typed_trl"]
    feats = datasets.Features({
        "messages": [{"role": datasets.Value("string"), "content": [
            {"type": datasets.Value("string"), "text": datasets.Value("string"), "index": datasets.Value("int64")}]}],
        "images": datasets.Sequence(datasets.Image()),
    })  # fmt: skip
    hf_row = dict(row, images=[str(media / A), str(media / B)])
    for fmt in ("parquet", "save_to_disk"):
        ds = datasets.Dataset.from_list([hf_row], features=feats)
        if fmt == "parquet":
            ds.to_parquet(str(media / "trl.parquet"))
            path = media / "trl.parquet"
        else:
            ds.save_to_disk(str(media / "trl_disk"))
            path = media / "trl_disk"
        got = samples(path, processor)
        assert got.conversation(0).layout == "typed"
        assert_same(got, samples(write_jsonl(media / "m.jsonl", [reference]), processor))
        assert got[0]["input_ids"].tolist() == hf_ids(processor, got.sources[0].row(0)["messages"], got)


def test_cauldron_and_llava_image_columns_from_datasets(media, processor):
    datasets = pytest.importorskip("datasets")
    for name, key in (("cauldron", "images"), ("llava", "image")):
        _, row, reference = cases(media)[name]
        image = datasets.Sequence(datasets.Image()) if key == "images" else datasets.Image()
        value = [str(media / p) for p in row[key]] if key == "images" else str(media / row[key])
        ds = datasets.Dataset.from_dict({**{k: [v] for k, v in row.items()}, key: [value]}).cast_column(key, image)
        ds.to_parquet(str(media / f"{name}.parquet"))
        got = samples(media / f"{name}.parquet", processor)
        assert got.conversation(0).layout == name
        assert_same(got, samples(write_jsonl(media / "m.jsonl", [reference]), processor))


# ---------------------------------------------------------------------------------------------
# Video as a list of frame files


def test_frame_list_video_equals_the_decoded_clip(tmp_path, processor):
    """A clip's own frames as PNG files, at the clip's fps, give the decoded clip's plan and pixels."""
    pytest.importorskip("av")
    from videos import LOSSLESS, write_video

    clip = write_video(tmp_path / "clip.mkv", 64, 48, 12, 8, codec=LOSSLESS)
    frames = []
    import av

    with av.open(str(clip)) as c:
        for k, f in enumerate(c.decode(c.streams.video[0])):
            frames.append(f"frames/{k:02d}.png")
            (tmp_path / "frames").mkdir(exist_ok=True)
            Image.fromarray(f.to_ndarray(format="rgb24")).save(tmp_path / frames[-1])
    typed = {"messages": [
        {"role": "user", "content": [{"type": "video", "video": frames, "fps": 8}, {"type": "text", "text": "What moves?"}]},
        {"role": "assistant", "content": "A square."}]}  # fmt: skip
    decoded = messages_row([("<video>What moves?", "A square.")], videos=["clip.mkv"])
    got = samples(write_jsonl(tmp_path / "t.jsonl", [typed]), processor)
    want = samples(write_jsonl(tmp_path / "m.jsonl", [decoded]), processor)
    assert got.index.videos(0) == want.index.videos(0) == [VideoMeta(12, 8.0, 64, 48)]
    assert_same(got, want)
    # the clip itself as LLaVA's singular video string and as a qwen-vl-utils file:// part
    llava = {"video": "clip.mkv", "conversations": [{"from": "human", "value": "<video>What moves?"},
                                                   {"from": "gpt", "value": "A square."}]}  # fmt: skip
    part = {"messages": [
        {"role": "user", "content": [{"type": "video", "video": f"file://{clip}"}, {"type": "text", "text": "What moves?"}]},
        {"role": "assistant", "content": "A square."}]}  # fmt: skip
    for name, row in (("llava", llava), ("typed", part)):
        ds = samples(write_jsonl(tmp_path / f"{name}.jsonl", [row]), processor)
        assert ds.conversation(0).layout == name
        assert_same(ds, want)
    # without an fps the list plays at data.video_fps: every frame kept (up to video_max_frames)
    lf = messages_row([("<video>What moves?", "A square.")], videos=[frames])  # LLaMA-Factory: videos: [[...]]
    ds = samples(write_jsonl(tmp_path / "lf.jsonl", [lf]), processor, video_fps=2.0)
    assert ds.index.videos(0) == [VideoMeta(12, 2.0, 64, 48)]
    assert ds.index.grids(0, "video")[0][0] == 12 // 2  # 12 frames, 2 per temporal patch


def test_frame_list_with_a_missing_or_odd_sized_frame_is_named(tmp_path):
    write_png(tmp_path / "f0.png", (64, 48), (1, 2, 3))
    write_png(tmp_path / "f1.png", (32, 48), (1, 2, 3))
    where = layouts.Location("d.jsonl", row=0)
    ref = MediaRef("video 0 of 1", frames=(MediaRef("frame 0", path=tmp_path / "f0.png"), MediaRef("frame 1", path=tmp_path / "f1.png")))
    with pytest.raises(BadSample, match="corrupt_video: video 0 of 1: frame 1 is 32x48 px, frame 0 is 64x48"):
        probe(ref, where)
    ref = MediaRef("video 0 of 1", frames=(MediaRef("frame 0", path=tmp_path / "f0.png"), MediaRef("frame 1", path=tmp_path / "nope.png")))
    with pytest.raises(BadSample, match="missing_video: .*frame 1: no such file"):
        probe(ref, where)


# ---------------------------------------------------------------------------------------------
# Refused rows, named by file and row

GOOD = {"image": A, "conversations": [{"from": "human", "value": "<image>Hi?"}, {"from": "gpt", "value": "Hi."}]}
BAD = {
    "llava count": ({"image": [A, B], "conversations": GOOD["conversations"]},
                    "image_count", "1 <image> placeholder but 2 images (layout llava: media from 'image'/'video')"),
    "singular key in messages": ({**messages_row([("<image>Hi?", "Hi.")]), "image": A, "images": []},
                                 "bad_format", "the row has 'image', but layout messages (detected) takes media from 'images' and 'videos'"),
    "url": ({"image": "https://example.com/a.png", "conversations": GOOD["conversations"]},
            "media_url", "image 0 of 1 is a URL (https://example.com/a.png); URLs are not fetched; download the files and give paths"),
    "typed url": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x.org/a.png"}}]},
                                {"role": "assistant", "content": "Hi."}]}, "media_url", "URLs are not fetched"),
    "grounding objects": ({**messages_row([("<image>Find <ref-object>", "<bbox>")], [A]),
                           "objects": {"ref": ["cat"], "bbox": [[1, 2, 3, 4]]}}, "bad_format", "ms-swift grounding"),
    "grounding text": (messages_row([("<image>Find <ref-object>", "here")], [A]), "bad_format", "contains <ref-object>"),
    "qwen-vl tag with images": (messages_row([(f"<img>{A}</img>Hi?", "Hi.")], [A]), "bad_format",
                                "message 0 contains a Qwen-VL <img>...</img> tag, but layout messages takes images from 'images'/'videos'"),
    "tools": ({"query": "Hi?", "response": "Hi.", "tools": '[{"name": "f"}]'}, "bad_format", "does not read them"),
    "loss weight": ({"messages": [{"role": "user", "content": [{"type": "text", "value": "Hi?"}], "loss_weight": 0.0},
                                  {"role": "assistant", "content": [{"type": "text", "value": "Hi."}], "loss_weight": 0.0}]},
                    "bad_format", "message 1 (assistant) has loss_weight=0.0"),
    "typed audio": ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
                                  {"role": "assistant", "content": "Hi."}]}, "bad_format", "message 0 part 0 has type 'audio'"),
    "trl too few images": ({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]},
                                         {"role": "assistant", "content": "Hi."}], "images": [A]},
                           "image_count", "message 0 part 1 is an image part without a source, and the row's 'images' has only 1 entry"),
    "trl too many images": ({"messages": [{"role": "user", "content": [{"type": "image"}]},
                                          {"role": "assistant", "content": "Hi."}], "images": [A, B]},
                            "image_count", "1 image part without a source but 2 entries in 'images'"),
    "cauldron": ({"images": [A], "texts": [{"user": "Hi?"}]}, "bad_format", "'texts' entry 0 must be"),
    "swift history": ({"query": "Hi?", "response": "Hi.", "history": [["only one"]]}, "bad_format", "'history' entry 0"),
    "alpaca no output": ({"instruction": "Hi?"}, "empty_reply", "message 1 is an empty assistant reply"),
    "zero width reply": (messages_row([("Hi?", "\u200b\u200d\ufeff")]), "empty_reply", "message 1 is an assistant reply made only of invisible characters"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_bad_rows_are_named_by_file_and_row(media, processor, name):
    row, reason, detail = BAD[name]
    path = write_jsonl(media / "d.jsonl", [GOOD, row, GOOD])
    _, report = read_dataset(make_cfg(path=str(path)).data, processor, use_cache=False)
    assert report.skipped == 1, report.messages
    assert report.messages[0].startswith(f"{path}: row 1 (line 2): {reason}: "), report.messages[0]
    assert detail in report.messages[0]


@pytest.mark.parametrize("reply", ["\u200b", "\u200d", "\ufeff", " \u200b\n"])
def test_invisible_reply_is_empty(media, processor, reply):
    path = write_jsonl(media / "d.jsonl", [GOOD, messages_row([("Hi?", reply)])])
    _, report = read_dataset(make_cfg(path=str(path)).data, processor, use_cache=False)
    assert report.by_reason == {"empty_reply": 1}


@pytest.mark.parametrize(
    "forced, row, detail",
    [
        ("sharegpt", GOOD, "the row has 'image', but data.layout=sharegpt takes media from 'images' and 'videos'"),
        ("llava", messages_row([("Hi?", "Hi.")]), "data.layout=llava expects 'conversations'; the row has keys ['images', 'messages'] (layout messages)"),
        ("messages", cases(Path("/"))["typed_trl"][1], "data.layout=messages, but message contents are lists of typed parts (layout typed)"),
        ("cauldron", {"query": "Hi?", "response": "Hi."}, "data.layout=cauldron expects 'texts'; the row has keys ['query', 'response'] (layout swift_query)"),
    ],
)
def test_a_forced_layout_refuses_rows_that_do_not_fit(media, processor, forced, row, detail):
    path = write_jsonl(media / "d.jsonl", [row])
    _, report = read_dataset(make_cfg(path=str(path), layout=forced).data, processor, use_cache=False)
    assert report.skipped == 1 and detail in report.messages[0], report.messages


def test_bad_layout_name_is_refused_by_the_config():
    with pytest.raises(ValueError, match="data.layout"):
        qconfig.load(overrides={"data.layout": "llava15"})


# ---------------------------------------------------------------------------------------------
# Detection on mixed files, and what data check prints


def test_detection_per_row_on_mixed_files(media, processor, capsys):
    c = cases(media)
    (media / "data").mkdir()
    (media / "data" / "img").symlink_to(media / "img")
    mixed = write_jsonl(
        media / "data" / "mixed.jsonl",
        [c["llava"][1], c["sharegpt"][1], c["typed_llamafactory_v1"][1], c["llava_list"][1]],
    )
    alpaca = write_jsonl(media / "data" / "alpaca.jsonl", [c["alpaca"][1], c["alpaca"][1]])
    dataset = samples(media / "data", processor)
    assert [dataset.conversation(i).layout for i in range(len(dataset))] == [
        "alpaca", "alpaca", "llava", "sharegpt", "typed", "llava"]  # fmt: skip
    assert cli_main(["data", "check", str(media / "data")]) == 0
    out = capsys.readouterr().out
    assert f"layout: alpaca (instruction/input/output), 2 rows in {alpaca}" in out
    assert f"layout: llava (image/conversations), 2 rows; sharegpt (conversations/images), 1 row; typed (typed content parts), 1 row in {mixed}" in out
    # keys no reader reads are listed once per file: InternVL's width/height (LLaMA-Factory v1's
    # loss_weight is read: the default weights are what qwenkit learns, others are refused)
    assert "  keys not read (ignored): height, width" in out
    assert out.count("keys not read") == 1


# ---------------------------------------------------------------------------------------------
# Every layout through the CLI: data check, then 2 training steps


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "qwenkit.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


TRAINED = [n for n in CASES if n != "typed_openai"]  # (its data URI is a path in another file's directory)


@pytest.mark.parametrize("name", TRAINED)
def test_every_layout_passes_data_check(media, name, capsys):
    expected, row, _ = cases(media)[name]
    path = write_jsonl(media / f"{name}.jsonl", [row] * 4)
    assert cli_main(["data", "check", str(path), f"data.layout={expected}"]) == 0
    assert f"layout: {expected} ({layouts.LAYOUTS[expected].describe}), 4 rows in {path}" in capsys.readouterr().out


@pytest.mark.slow
def test_every_layout_trains_two_steps(media):
    """One file per layout in one directory, each micro-batch all of them: both steps train every layout."""
    (media / "all").mkdir()
    (media / "all" / "img").symlink_to(media / "img")
    for name in TRAINED:
        write_jsonl(media / "all" / f"{name}.jsonl", [cases(media)[name][1]])
    proc = _cli("train", "--nproc", "1", f"data.path={media / 'all'}", "parallel.device=cpu", "data.shuffle=false",
                "train.steps=2", "train.warmup_steps=0", f"train.micro_batch_size={len(TRAINED)}", "checkpoint.every=0",
                f"train.output_dir={media / 'run'}", f"data.cache_dir={media / 'cache'}")  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert f"data: {len(TRAINED)} samples" in log and "(0 skipped)" in log
    assert [e["step"] for e in events.read(media / "run") if e["event"] == "step"] == [1, 2]


# ---------------------------------------------------------------------------------------------
# #22: transparent images, images replaced after the index was built


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_images_are_converted_as_hf_does(tmp_path, processor, mode):
    """The left half is fully transparent (alpha 0, or palette entry 0 marked transparent)."""
    rng = np.random.default_rng(0)
    if mode == "P":
        index = rng.integers(1, 16, (48, 64), dtype=np.uint8)
        index[:, :32] = 0
        im = Image.fromarray(index, "P")
        im.putpalette([0, 0, 0] + rng.integers(0, 256, 45).tolist())
        im.info["transparency"] = 0
    else:
        rgba = rng.integers(0, 256, (48, 64, 4), dtype=np.uint8)
        rgba[:, :32, 3] = 0
        im = Image.fromarray(rgba, "RGBA").convert(mode)
    im.save(tmp_path / "t.png")
    dataset = samples(write_jsonl(tmp_path / "d.jsonl", [messages_row([("<image>Hi?", "Hi.")], ["t.png"])]), processor)
    with Image.open(tmp_path / "t.png") as raw:
        assert raw.mode == mode
        hf = processor.image_processor(images=[raw], return_tensors="pt")
    torch.testing.assert_close(dataset[0]["pixel_values"], hf["pixel_values"], rtol=0, atol=0)
    if int(transformers.__version__.split(".")[0]) >= 5:  # 5.x's convert_to_rgb composites on white
        assert load(dataset.image_refs(0)[0], dataset.conversation(0).where).getpixel((0, 0)) == (255, 255, 255)


def _replaced_set(tmp_path):
    for k in range(3):
        write_png(tmp_path / f"{k}.png", (64, 48), (50 * k, 30, 30))
    rows = [messages_row([("<image>Hi?", f"Colour {k}.")], [f"{k}.png"]) for k in range(3)]
    return write_jsonl(tmp_path / "d.jsonl", rows)


@pytest.mark.parametrize("policy", ["skip", "error"])
def test_an_image_replaced_after_the_index_is_a_bad_sample(tmp_path, processor, caplog, policy):
    path = _replaced_set(tmp_path)
    cfg = make_cfg(path=str(path), shuffle=False, cache_dir=str(tmp_path / "cache"), on_bad_sample=policy).data
    read_dataset(cfg, processor)  # the index is built and cached
    write_png(tmp_path / "1.png", (300, 200), (1, 2, 3))  # replaced by a larger image: another grid
    dataset, _ = read_dataset(cfg, processor)
    assert dataset.index_origin.startswith("index from cache")  # the cache still matches: the data file is unchanged
    if policy == "error":
        with pytest.raises(BadSample, match=r"d.jsonl: row 1 \(line 2\): changed_media: .*qwenkit data prepare"):
            dataset[1]
        return
    with caplog.at_level(logging.WARNING, logger="qwenkit.data"):
        sample = dataset[1]
    assert int(sample["num_bad"]) == 1  # counted: the next good sample stands in
    assert torch.equal(sample["input_ids"], dataset[2]["input_ids"])
    assert "changed_media" in caplog.text and "rebuild the index" in caplog.text


