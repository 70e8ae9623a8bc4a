"""qwenkit.data.template: the system prompt (the family's default, a row's own, ``data.system_prompt``)
against HF's chat template, and ``data.truncate_text`` cutting after the last image."""

from __future__ import annotations

import json

import torch
from conftest import hf_reference_ids, make_cfg, write_png

from qwenkit.data import read_dataset


def test_default_and_custom_system_prompt(tmp_path, processor):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ]
        },
    ]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows))
    dataset, _ = read_dataset(make_cfg().data, processor, str(path))
    for i, row in enumerate(rows):
        assert dataset[i]["input_ids"].tolist() == hf_reference_ids(processor, row, [])
    decoded = processor.tokenizer.decode(dataset[0]["input_ids"])
    assert decoded.startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi"
    )
    other = read_dataset(make_cfg(system_prompt="Answer in French.").data, processor, str(path))[0]
    assert "Answer in French." in processor.tokenizer.decode(other[0]["input_ids"])
    assert "Be brief." in processor.tokenizer.decode(other[1]["input_ids"])


def test_truncate_text_cuts_after_the_last_image(tmp_path, processor):
    write_png(tmp_path / "a.png", (112, 112))
    long_reply = " ".join(["word"] * 200)
    rows = [
        {
            "messages": [
                {"role": "user", "content": "<image>Describe."},
                {"role": "assistant", "content": long_reply},
            ],
            "images": ["a.png"],
        }
    ]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows))
    full, _ = read_dataset(make_cfg(max_length=4096).data, processor, str(path))
    cut, report = read_dataset(make_cfg(max_length=64, truncate_text=True).data, processor, str(path))
    assert report.skipped == 0 and cut.samples[0].truncated
    a, b = full[0], cut[0]
    assert len(b["input_ids"]) == 64
    assert torch.equal(b["input_ids"], a["input_ids"][:64]) and torch.equal(b["labels"], a["labels"][:64])
    assert torch.equal(b["pixel_values"], a["pixel_values"])
    n_pad = processor.image_tokens(a["image_grid_thw"][0])
    assert int((b["input_ids"] == processor.image_token_id).sum()) == n_pad
