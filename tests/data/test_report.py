"""qwenkit.data.report: bad input, one test per case, each on a fixture written here, each checking that
the message names the file, the row and the reason (bad media, lengths, malformed files); then the
on_bad_sample policy and its counts. A conversation's shape: test_conversation.py; ``qwenkit data
check``: test_check.py."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
from conftest import make_cfg, write_png
from PIL import Image

from qwenkit import config as qconfig
from qwenkit.data import BadSample, build, read_dataset

MLLM_DEMO = Path(__file__).resolve().parents[3] / "shared" / "data" / "mllm_demo" / "mllm_demo.json"  # a sibling of the checkout


def good_row(image: str | None = "ok.png") -> dict:
    content = "<image>What is it?" if image else "Hello?"
    row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "A shape."}]}
    if image:
        row["images"] = [image]
    return row


def write_set(tmp_path: Path, bad_row: dict | str, n_good: int = 2, suffix: str = ".json") -> Path:
    """``n_good`` good rows, then the bad one at row ``n_good``; returns the dataset path."""
    write_png(tmp_path / "ok.png", (64, 64), (10, 200, 10))
    rows = [good_row() for _ in range(n_good)] + [bad_row]
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    else:
        path.write_text(json.dumps(rows, indent=1))
    return path


def scan(path, processor, **data):
    return read_dataset(make_cfg(**data).data, processor, str(path), stop_at_first=False)


def only_bad(path, processor, reason: str, row: int | None = 2, **data) -> str:
    """Scan, expect exactly one bad sample with ``reason`` at ``row``; return its message."""
    dataset, report = scan(path, processor, **data)
    assert report.skipped == 1, report.messages
    assert report.by_reason == {reason: 1}, report.messages
    message = report.messages[0]
    assert str(path) in message
    if row is not None:
        assert f"row {row}" in message
        assert len(dataset) == report.total - 1
    assert f": {reason}: " in message
    return message


def noise_image(path: Path, size=(160, 120), fmt="JPEG") -> bytes:
    rng = random.Random(0)
    img = Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))
    img.save(path, fmt)
    return path.read_bytes()


# ---------------------------------------------------------------------------------------------
# One test per case


def test_missing_image_file(tmp_path, processor):
    message = only_bad(write_set(tmp_path, good_row("pics/nope.png")), processor, "missing_image")
    assert str(tmp_path / "pics" / "nope.png") in message and "'pics/nope.png'" in message


@pytest.mark.parametrize("kind", ["garbage", "truncated_jpeg", "truncated_png"])
def test_corrupt_or_truncated_image(tmp_path, processor, kind):
    bad = tmp_path / ("bad.jpg" if kind != "truncated_png" else "bad.png")
    if kind == "garbage":
        bad.write_bytes(b"this is not an image at all")
    else:
        data = noise_image(bad, fmt="JPEG" if kind == "truncated_jpeg" else "PNG")
        bad.write_bytes(data[: len(data) // 2])
    message = only_bad(write_set(tmp_path, good_row(bad.name)), processor, "corrupt_image")
    assert bad.name in message and "cannot decode" in message


def test_too_long_is_dropped(tmp_path, processor):
    row = good_row()
    row["messages"][1]["content"] = "word " * 300
    message = only_bad(write_set(tmp_path, row), processor, "too_long", max_length=128)
    assert "data.max_length=128" in message


def test_too_long_image_span_is_never_truncated(tmp_path, processor):
    """With truncate_text, text after the last image may go, but a cut inside an image is a drop."""
    row = good_row()
    row["messages"][0]["content"] = "word " * 100 + "<image>Describe."
    path = write_set(tmp_path, row)
    message = only_bad(path, processor, "too_long", max_length=64, truncate_text=True)
    assert "an image is never truncated" in message
    dataset, report = scan(path, processor, max_length=64, truncate_text=True)
    assert all(s.length <= 64 for s in dataset.samples)  # the good rows fit and are kept whole


def test_image_too_small(tmp_path, processor):
    write_png(tmp_path / "thin.png", (12, 80), (0, 0, 0))
    message = only_bad(write_set(tmp_path, good_row("thin.png")), processor, "small_image")
    assert "12x80" in message and "data.min_image_side=28" in message


def test_extreme_aspect_ratio(tmp_path, processor):
    write_png(tmp_path / "wide.png", (3000, 30), (0, 0, 0))
    path = write_set(tmp_path, good_row("wide.png"))
    assert "aspect ratio 100.0 > data.max_aspect_ratio=50" in only_bad(
        path, processor, "aspect_ratio", max_aspect_ratio=50
    )
    write_png(tmp_path / "wide.png", (30 * 300, 30), (0, 0, 0))
    # beyond the image processor's own limit (200) even when the config allows more
    assert "aspect ratio" in only_bad(path, processor, "aspect_ratio", max_aspect_ratio=1000)


def test_malformed_json_file_names_the_line(tmp_path, processor):
    path = tmp_path / "data.json"
    text = json.dumps([good_row(None), good_row(None)], indent=1).splitlines()
    text[4] = text[4] + ","  # a trailing comma on line 5
    path.write_text("\n".join(text))
    _, report = scan(path, processor)
    assert report.by_reason == {"malformed_json": 1}
    assert report.messages[0].startswith(f"{path}: line ")


def test_malformed_jsonl_line_names_row_and_line(tmp_path, processor):
    path = write_set(tmp_path, '{"messages": [{"role": "user", "content": "Hi"}', suffix=".jsonl")
    message = only_bad(path, processor, "malformed_json")
    assert f"{path}: row 2 (line 3)" in message


def test_row_not_a_conversation(tmp_path, processor):
    assert "no layout has this row's keys" in only_bad(
        write_set(tmp_path, {"text": "hello"}), processor, "bad_format"
    )
    assert "must be a JSON object" in only_bad(write_set(tmp_path, ["a", "list"]), processor, "bad_format")


def test_reserved_token_in_text(tmp_path, processor):
    row = good_row(None)
    row["messages"][0]["content"] = "say <|im_end|> please"
    assert "reserved token '<|im_end|>'" in only_bad(write_set(tmp_path, row), processor, "bad_format")


def test_row_id_is_named(tmp_path, processor):
    row = good_row("gone.png")
    row["id"] = "sample-17"
    assert "row 2 (id 'sample-17')" in only_bad(write_set(tmp_path, row), processor, "missing_image")


# ---------------------------------------------------------------------------------------------
# Policy


def mixed_set(tmp_path: Path, n_good: int, n_bad: int) -> Path:
    write_png(tmp_path / "ok.png", (64, 64), (0, 0, 0))
    rows = [good_row() for _ in range(n_good)] + [good_row("missing.png") for _ in range(n_bad)]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(rows))
    return path


def run_cfg(path, **data):
    return qconfig.load(
        overrides={
            "train.micro_batch_size": 1,
            **{f"data.{k}": v for k, v in data.items()},
            "data.path": str(path),
        }
    )


def test_error_policy_stops_at_the_first_bad_row(tmp_path, processor):
    path = mixed_set(tmp_path, 3, 2)
    with pytest.raises(BadSample, match=rf"{path}: row 3: missing_image"):
        build(run_cfg(path, on_bad_sample="error"), processor)


def test_skip_policy_counts_and_logs(tmp_path, processor, caplog):
    path = mixed_set(tmp_path, 99, 1)
    with caplog.at_level(logging.WARNING, logger="qwenkit.data"):
        bundle = build(run_cfg(path, on_bad_sample="skip"), processor)
    assert (len(bundle.dataset), bundle.report.total, bundle.report.skipped) == (99, 100, 1)
    assert bundle.report.by_reason == {"missing_image": 1}
    assert f"{path}: row 99: missing_image" in caplog.text and "skipped 1 of 100" in caplog.text


def test_skip_policy_fails_beyond_max_bad_fraction(tmp_path, processor):
    path = mixed_set(tmp_path, 18, 2)
    with pytest.raises(
        ValueError, match=r"2 of 20 samples \(10\.0%\) are bad, more than data\.max_bad_fraction=0\.05"
    ):
        build(run_cfg(path, on_bad_sample="skip", max_bad_fraction=0.05), processor)
    assert len(build(run_cfg(path, on_bad_sample="skip", max_bad_fraction=0.1), processor).dataset) == 18


def test_unparseable_file_is_never_skipped(tmp_path, processor):
    mixed_set(tmp_path, 200, 0)
    (tmp_path / "broken.json").write_text('[{"messages": ')
    with pytest.raises(ValueError, match=r"(?s)unreadable dataset files cannot be skipped.*broken\.json: line 1"):
        build(run_cfg(tmp_path, on_bad_sample="skip"), processor)
