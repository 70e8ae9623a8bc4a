"""GRPO's rows (the objective reads ``prompts``): the reference is a ``solution`` / ``answer`` column
where the row has one (TRL's and EasyR1's sets), else the last reply; a prompt alone is a row then
(EasyR1's ``problem`` and TRL's ``prompt``: layout ``prompt``, or a conversation ending with the
user's turn). The reference rows are
the same prompt written as an SFT conversation, read through the same template."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_cfg, write_png

from qwenkit.data import read_dataset
from qwenkit.data.collator import Collator
from qwenkit.engine.generation.evaluate import Evaluator

QUESTION = "<image>What colour is this box?"
USER = [{"role": "user", "content": QUESTION}]


@pytest.fixture
def box(tmp_path):
    write_png(tmp_path / "img" / "a.png", (64, 48), (200, 30, 30))
    return tmp_path


def rows():
    """(row, its reference as GRPO reads it); every prompt is the same question about one image."""
    return [
        ({"problem": QUESTION, "answer": "Red", "images": ["img/a.png"]}, "Red"),  # EasyR1
        ({"problem": "What colour is this box?", "solution": "Red", "image": "img/a.png"}, "Red"),  # TRL's hub sets: no placeholder
        ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this box?"}]}],
          "image": "img/a.png", "solution": "Red"}, "Red"),  # TRL's conversational prompt
        ({"messages": USER, "images": ["img/a.png"], "solution": 7}, "7"),  # a prompt-only conversation, a number
        ({"messages": [*USER, {"role": "assistant", "content": "It is red."}], "images": ["img/a.png"],
          "answer": "Red", "solution": "red"}, "red"),  # a reply and both columns: solution first
        ({"messages": [*USER, {"role": "assistant", "content": "It is red."}], "images": ["img/a.png"]}, "It is red."),
    ]  # fmt: skip


def read(path, processor, reads="conversations"):
    return read_dataset(make_cfg(path=str(path), shuffle=False).data, processor, use_cache=False, reads=reads)


def test_a_reference_column_is_the_reference_and_a_prompt_alone_a_row(box, processor):
    path = box / "rl.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row, _ in rows()))
    dataset, report = read(path, processor, reads="prompts")
    assert report.skipped == 0, report.messages
    assert [dataset.conversation(i).reference for i in range(len(dataset))] == [ref for _, ref in rows()]
    assert dataset.conversation(0).layout == dataset.conversation(2).layout == "prompt"
    first, _ = dataset.prompt(0)
    for i in range(1, len(dataset)):  # one prompt, however it is written
        inputs, _ = dataset.prompt(i)
        assert inputs.keys() == first.keys()
        for key in inputs:
            assert torch.equal(inputs[key], first[key]), (i, key)


def test_sft_refuses_a_prompt_alone_naming_its_column(box, processor):
    path = box / "rl.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row, _ in rows()))
    dataset, report = read(path, processor)
    assert len(dataset) == 2 and report.by_reason == {"no_reply": 4}, report.messages
    assert report.messages[0] == (
        f"{path}: row 0 (line 1): no_reply: the conversation ends with a user turn and the row's 'answer' column is "
        "its reference: a prompt for train.objective=grpo, with no reply to learn"
    )
    assert [dataset.conversation(i).reference for i in range(2)] == ["It is red.", "It is red."]  # SFT: the reply


def test_a_preference_row_read_as_prompts_is_named(box, processor):
    path = box / "dpo.jsonl"
    path.write_text(json.dumps({"prompt": "Hi?", "chosen": "Hello.", "rejected": "Go away."}) + "\n")
    for reads in ("conversations", "prompts"):
        _, report = read(path, processor, reads)
        assert report.messages[0].endswith("a preference row (prompt/chosen/rejected): train.objective=dpo reads it")


@pytest.mark.parametrize("value, reason, detail", [
    (["Red"], "bad_format", "the 'answer' column must be a string or a number, got list"),
    (" ", "empty_reply", "the 'answer' column (the reference) is empty"),
])  # fmt: skip
def test_a_bad_reference_column_is_named(box, processor, value, reason, detail):
    path = box / "rl.jsonl"
    path.write_text(json.dumps({"problem": QUESTION, "answer": value, "images": ["img/a.png"]}) + "\n")
    _, report = read(path, processor, reads="prompts")
    assert report.by_reason == {reason: 1} and report.messages[0].endswith(detail), report.messages


def test_easyr1_parquet_with_an_image_sequence(box, processor):
    datasets = pytest.importorskip("datasets")
    jsonl = box / "rl.jsonl"
    jsonl.write_text(json.dumps(rows()[0][0]) + "\n")
    features = datasets.Features({"problem": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "images": datasets.Sequence(datasets.Image())})  # fmt: skip
    row = dict(rows()[0][0], images=[str(box / "img" / "a.png")])
    datasets.Dataset.from_list([row], features=features).to_parquet(str(box / "rl.parquet"))
    (got, report), (want, _) = read(box / "rl.parquet", processor, "prompts"), read(jsonl, processor, "prompts")
    assert report.skipped == 0 and got.conversation(0).reference == "Red"
    a, b = got.prompt(0)[0], want.prompt(0)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_eval_set_of_prompts_alone_has_no_eval_loss(box, processor):
    """GRPO's held-out rows may have no reply: evaluation scores generations against their column,
    and leaves out the eval loss (no label token to average), instead of failing the run."""
    path = box / "rl.jsonl"
    path.write_text(json.dumps(rows()[0][0]) + "\n")
    dataset, _ = read(path, processor, reads="prompts")
    cfg = make_cfg()
    cfg.train.eval_samples = 0  # no generation: run() would compute only the eval loss
    evaluator = Evaluator(cfg, dataset, Collator(processor), 0, 1, torch.device("cpu"), box)
    assert evaluator.due(0) and evaluator.run(0, model=None) == {}  # no forward: nothing to compute


@pytest.mark.parametrize("row", [
    {"problem": "", "answer": "6"},  # EasyR1, nothing asked
    {"messages": [{"role": "user", "content": " \u200b"}], "solution": "2"},  # invisible characters only
    {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "It is red."}]},  # the reply as reference
])  # fmt: skip
def test_an_empty_prompt_is_a_bad_row_named_not_a_rollout_from_nothing(box, processor, row):
    """A prompt with no text and no image or video was accepted without a word: every completion of it
    sampled from nothing. It is a bad row now (skipped, named in the log, counted by data.max_bad_fraction)."""
    path = box / "rl.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({"problem": QUESTION, "answer": "Red", "images": ["img/a.png"]}) + "\n")
    dataset, report = read(path, processor, reads="prompts")
    assert report.by_reason == {"empty_prompt": 1} and len(dataset) == 1, report.messages
    assert report.messages[0].startswith(f"{path}: row 0 (line 1): empty_prompt: the prompt has no text"), report.messages
