"""Multi-turn tool SFT rows (issue 61; qwenkit.data.tool_turns, the template's tool turns): each tool layout (HF
messages with ``tool_calls`` and ``role: tool``, typed parts with an image a tool returned, LLaMA-Factory sharegpt
``function_call`` / ``observation``, ms-swift ``tool_call`` / ``tool_response``) gives, in every family, the token ids
of the official template TRL ships (``trl/chat_templates/qwen3_vl.jinja``: hermes, Qwen2.5-VL's own template has
no tool branch; ``qwen3_5_nothink.jinja``: xml) on the equivalent HF messages; labels learn the replies with their
calls, never a tool response; bad rows are named by file, row and message; the shipped tiny tool dataset's schemas
are ``get_json_schema``'s of the agentic task's tools."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from conftest import EVERY_FAMILY, make_cfg, over_families, runs, tiny_processor, write_png

from data.test_report import only_bad, write_set
from qwenkit import config as qconfig
from qwenkit.data import read_dataset
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.tiny.data import TOOL_SCHEMAS

A, B = "img/a.png", "img/b.png"
SCHEMAS = list(TOOL_SCHEMAS)
ZOOM = {"name": "zoom", "arguments": {"quadrant": "top left"}}
COLOUR = {"name": "shape_colour", "arguments": {"name": "red"}}
SHAPE = {"name": "zoom", "arguments": {"quadrant": "bottom right"}}


def fn(call: dict, arguments=None) -> dict:
    return {"type": "function", "function": dict(call, **({} if arguments is None else {"arguments": arguments}))}


def cases() -> dict[str, tuple[dict, dict]]:
    """name -> (the row in its layout, the equivalent HF row: messages with tool_calls / role tool, tools)."""
    hf_messages = {"messages": [
        {"role": "system", "content": "You look at shapes."},
        {"role": "user", "content": "<image>What colour is it, and its RGB value?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [fn(ZOOM), fn(COLOUR, '{"name": "red"}')]},
        {"role": "tool", "content": "a red square"}, {"role": "tool", "content": "[220, 40, 40]"},
        {"role": "assistant", "content": "Red, [220, 40, 40]."},
        {"role": "user", "content": "And the last shape?"},
        {"role": "assistant", "content": None, "tool_calls": [fn(SHAPE)]},
        {"role": "tool", "content": "a square"}, {"role": "assistant", "content": "A square."}],
        "images": [A], "tools": SCHEMAS}  # fmt: skip
    typed = {"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Zoom in: what colour?"}]},
        {"role": "assistant", "content": "", "tool_calls": [fn(ZOOM)]},
        {"role": "tool", "content": [{"type": "text", "text": "the crop: "}, {"type": "image"}]},
        {"role": "assistant", "content": "Red."}], "images": [A, B], "tools": SCHEMAS}  # fmt: skip
    sharegpt = {"conversations": [
        {"from": "human", "value": "<image>What colour is it, and its RGB value?"},
        {"from": "function_call", "value": json.dumps([ZOOM, COLOUR])},
        {"from": "observation", "value": "a red square, [220, 40, 40]"},
        {"from": "gpt", "value": "Red, [220, 40, 40]."},
        {"from": "human", "value": "And the last shape?"},
        {"from": "function_call", "value": json.dumps(SHAPE)},
        {"from": "observation", "value": "a square"}, {"from": "gpt", "value": "A square."}],
        "system": "You look at shapes.", "images": [A], "tools": json.dumps([t["function"] for t in SCHEMAS])}  # fmt: skip
    sharegpt_hf = {"messages": [
        {"role": "system", "content": "You look at shapes."},
        {"role": "user", "content": "<image>What colour is it, and its RGB value?"},
        {"role": "assistant", "content": "", "tool_calls": [fn(ZOOM), fn(COLOUR)]},
        {"role": "tool", "content": "a red square, [220, 40, 40]"},
        {"role": "assistant", "content": "Red, [220, 40, 40]."},
        {"role": "user", "content": "And the last shape?"},
        {"role": "assistant", "content": "", "tool_calls": [fn(SHAPE)]},
        {"role": "tool", "content": "a square"}, {"role": "assistant", "content": "A square."}],
        "images": [A], "tools": SCHEMAS}  # fmt: skip
    swift = {"messages": [
        {"role": "user", "content": "<image>What colour is it, and its RGB value?"},
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool_call", "content": json.dumps(ZOOM)}, {"role": "tool_call", "content": json.dumps(COLOUR)},
        {"role": "tool_response", "content": "a red square"}, {"role": "tool_response", "content": "[220, 40, 40]"},
        {"role": "assistant", "content": "Red, [220, 40, 40]."}], "images": [A], "tools": json.dumps(SCHEMAS)}  # fmt: skip
    swift_hf = {"messages": [
        {"role": "user", "content": "<image>What colour is it, and its RGB value?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [fn(ZOOM), fn(COLOUR)]},
        {"role": "tool", "content": "a red square"}, {"role": "tool", "content": "[220, 40, 40]"},
        {"role": "assistant", "content": "Red, [220, 40, 40]."}], "images": [A], "tools": SCHEMAS}  # fmt: skip
    return {"hf_messages": (hf_messages, hf_messages), "typed": (typed, typed), "sharegpt": (sharegpt, sharegpt_hf),
            "swift": (swift, swift_hf)}  # fmt: skip


LAYOUT = {"hf_messages": "messages", "typed": "typed", "sharegpt": "sharegpt", "swift": "messages"}


def official_template(style: str) -> str:
    trl = pytest.importorskip("trl")
    name = "qwen3_5_nothink.jinja" if style == "xml" else "qwen3_vl.jinja"
    return (Path(trl.__file__).parent / "chat_templates" / name).read_text()


def typed_parts(content):
    """A string content's ``<image>`` placeholders as typed parts (the official templates write strings as they are)."""
    if not isinstance(content, str) or "<image>" not in content:
        return content
    pieces = re.split(r"(<image>)", content)
    return [{"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in pieces if p]


def reference_ids(processor, hf_row: dict, grids) -> list[int]:
    """The official template's rendering of ``hf_row`` (the family's default system text as a system message,
    as the kit writes it; Qwen3.5 takes mappings as arguments), each image pad expanded by its grid."""
    family, messages = processor.family, copy.deepcopy(hf_row["messages"])
    for m in messages:
        m["content"] = typed_parts(m["content"])
        for c in m.get("tool_calls", ()):
            if family.tool_calls == "xml" and isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    if messages[0]["role"] != "system" and family.default_system:
        messages.insert(0, {"role": "system", "content": family.default_system})
    text = processor.tokenizer.apply_chat_template(messages, tools=hf_row["tools"], tokenize=False,
                                                   chat_template=official_template(family.tool_calls))  # fmt: skip
    left = iter(grids)
    text = re.sub(re.escape("<|image_pad|>"), lambda _: "<|image_pad|>" * processor.image_tokens(next(left)), text)
    return processor.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def media(tmp_path):
    write_png(tmp_path / A, (64, 48), (200, 30, 30))
    write_png(tmp_path / B, (56, 56), (30, 30, 200))
    return tmp_path


def read(path: Path, processor, **data):
    cfg = qconfig.load(overrides=[f"data.path={path}", "data.shuffle=false", "data.max_length=4096",
                                  *(f"data.{k}={v}" for k, v in data.items())])  # fmt: skip
    dataset, report = read_dataset(cfg.data, processor, use_cache=False)
    assert report.skipped == 0, report.messages
    return dataset


@EVERY_FAMILY
@pytest.mark.parametrize("name", list(LAYOUT))
def test_each_tool_layout_renders_as_the_official_template(media, family, name):
    processor = tiny_processor(family)
    row, hf_row = cases()[name]
    (media / "rows.json").write_text(json.dumps([row]))
    dataset = read(media / "rows.json", processor)
    conv = dataset.conversation(0)
    assert conv.layout == LAYOUT[name] and conv.tools == SCHEMAS
    want = reference_ids(processor, hf_row, dataset.index.grids(0))
    got = dataset[0]["input_ids"].tolist()
    assert got == want


CALL_TEXT = {
    "hermes": ['Let me look.\n<tool_call>\n{"name": "zoom", "arguments": {"quadrant": "top left"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "shape_colour", "arguments": {"name": "red"}}\n</tool_call>', "Red, [220, 40, 40]."],
    "xml": ["Let me look.\n\n<tool_call>\n<function=zoom>\n<parameter=quadrant>\ntop left\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=shape_colour>\n<parameter=name>\nred\n</parameter>\n</function>\n"
            "</tool_call>", "Red, [220, 40, 40]."],
}  # fmt: skip


@over_families("qwen2_5_vl", "qwen3_5")
def test_labels_learn_the_calls_and_never_a_tool_response(media, family):
    """The learned runs are exactly each reply with its calls and its <|im_end|>; every token of the tool
    responses' turn (and its image) is IGNORE_INDEX."""
    processor = tiny_processor(family)
    (media / "rows.json").write_text(json.dumps([cases()["swift"][0]]))
    sample = read(media / "rows.json", processor)[0]
    ids, labels = sample["input_ids"], sample["labels"]
    learned = [processor.tokenizer.decode(ids[s:e]) for s, e in runs(labels != IGNORE_INDEX)]
    assert learned == [t + "<|im_end|>" for t in CALL_TEXT[processor.family.tool_calls]]
    text = processor.tokenizer.decode(ids)
    start = text.index("<|im_start|>user\n<tool_response>")
    tool_turn = slice(len(processor.tokenizer.encode(text[:start], add_special_tokens=False)),
                      len(processor.tokenizer.encode(text[: text.index("<|im_end|>", start) + 1], add_special_tokens=False)))  # fmt: skip
    assert "a red square" in processor.tokenizer.decode(ids[tool_turn])
    assert (labels[tool_turn] == IGNORE_INDEX).all()


def tool_row(messages, tools=SCHEMAS, **extra):
    return {"messages": messages, "tools": tools, **extra}


USER = {"role": "user", "content": "Which colour?"}
ANSWER = {"role": "assistant", "content": "Red."}
BAD_ROWS = {
    "call without a name": (tool_row([USER, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"arguments": {}}}]}, {"role": "tool", "content": "x"}, ANSWER]),
        "bad_tool", "message 1 tool call 0 has no 'name'"),
    "arguments not an object": (tool_row([USER, {"role": "assistant", "content": "", "tool_calls": [
        fn(COLOUR, "[1, 2]")]}, {"role": "tool", "content": "x"}, ANSWER]),
        "bad_tool", "message 1 tool call 0 'arguments' must be a JSON object, got list"),
    "swift call not JSON": (tool_row([USER, {"role": "tool_call", "content": "shape_colour(red)"},
                                      {"role": "tool_response", "content": "x"}, ANSWER]),
                            "bad_tool", "message 1 (tool_call) is a string but not JSON"),
    "response without a call": (tool_row([USER, {"role": "tool", "content": "x"}, ANSWER]),
                                "bad_tool", "message 1 is a tool response with no tool call before it"),
    "response after a reply without calls": (tool_row([USER, ANSWER, {"role": "tool", "content": "x"}, ANSWER]),
                                             "bad_tool", "message 2 is a tool response with no tool call before it"),
    "undefined tool": (tool_row([USER, {"role": "assistant", "content": "", "tool_calls": [fn({"name": "crop"})]},
                                 {"role": "tool", "content": "x"}, ANSWER]),
                       "bad_tool", "message 1 calls 'crop', which the row's 'tools' does not define (it defines shape_colour, zoom)"),
    "tools entry without a name": (tool_row([USER, ANSWER], tools=[{"description": "no name"}]),
                                   "bad_tool", "'tools' entry 0 has no function name"),
    "tools not JSON": (tool_row([USER, ANSWER], tools="[{"), "bad_tool", "'tools' is a string but not JSON"),
    "ends with a response": (tool_row([USER, {"role": "assistant", "content": "", "tool_calls": [fn(COLOUR)]},
                                       {"role": "tool", "content": "x"}]),
                             "turn_order", "the last message (2) is a tool response"),
    "user after a response": (tool_row([USER, {"role": "assistant", "content": "", "tool_calls": [fn(COLOUR)]},
                                        {"role": "tool", "content": "x"}, USER, ANSWER]),
                              "turn_order", "message 3 is from user, expected assistant after the tool responses"),
    "ms-swift messages keep their numbers": (tool_row([USER, {"role": "assistant", "content": "I will look."},
                                                        {"role": "tool_call", "content": json.dumps(COLOUR)},
                                                        {"role": "tool_response", "content": "x"}, USER, ANSWER]),
                                              "turn_order", "message 4 is from user, expected assistant after"),
    "a user message calls": (tool_row([dict(USER, tool_calls=[fn(COLOUR)]), ANSWER]),
                             "bad_tool", "message 0 (user) has 'tool_calls'; only an assistant message calls tools"),
    "tools in a layout that does not read them": ({"instruction": "Which colour?", "output": "Red.", "tools": SCHEMAS},
                                                  "bad_format", "layout alpaca (detected) does not read them"),
    "unknown role": (tool_row([USER, {"role": "robot", "content": "x"}, ANSWER]), "bad_role", "message 1 has role 'robot'"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_ROWS))
def test_bad_tool_rows_are_named(tmp_path, processor, name):
    row, reason, detail = BAD_ROWS[name]
    assert detail in only_bad(write_set(tmp_path, row), processor, reason)


def test_grpo_prompts_refuse_tool_rows(tmp_path, processor):
    row = tool_row([USER, {"role": "assistant", "content": "", "tool_calls": [fn(COLOUR)]},
                    {"role": "tool", "content": "x"}, ANSWER])  # fmt: skip
    _, report = read_dataset(make_cfg().data, processor, str(write_set(tmp_path, row)), reads="prompts", use_cache=False)
    assert report.by_reason == {"bad_tool": 1} and "GRPO's tools are grpo.tools" in report.messages[0]


def test_the_tiny_tool_questions_are_the_tool_rows_without_their_calls_and_read_as_grpo_prompts(tmp_path, processor):
    """data.tiny_task=tool_questions (the agentic recipe's prompts): each tool row's question, image and final answer,
    nothing of its call; read as GRPO's prompts with no bad row, and its environment opens each row's own image."""
    from PIL import Image, ImageChops

    from qwenkit.model.tiny.agentic import ShapesZoom
    from qwenkit.model.tiny.data import write_tool_dataset, write_tool_question_dataset

    tools = json.loads(write_tool_dataset(tmp_path / "tools", n=6).read_text())
    questions = json.loads(write_tool_question_dataset(tmp_path / "questions", n=6).read_text())
    answers = [t["messages"][-1]["content"] if "messages" in t else t["conversations"][-1]["value"] for t in tools]
    assert [q["messages"][1]["content"] for q in questions] == answers
    assert all(q["images"] == t["images"][:1] and len(q["messages"]) == 2 and q["messages"][0]["content"].startswith("<image>")
               for q, t in zip(questions, tools))  # fmt: skip
    assert {q["messages"][0]["content"] for q in questions} == {"<image>What is the RGB value of the shapes' colour?",
                                                                "<image>Zoom into the first shape: what colour is it?"}
    _, report = read_dataset(make_cfg().data, processor, str(tmp_path / "questions" / "tiny.json"), reads="prompts",
                             use_cache=False)  # fmt: skip
    assert report.by_reason == {}
    env, q = ShapesZoom(), qconfig.load(overrides=["train.objective=grpo", "data.tiny_task=tool_questions"])
    assert q.data.tiny_task == "tool_questions"
    from qwenkit.model.tiny.data import ensure_dataset

    folder = ensure_dataset(8, task="tool_questions").parent
    row = json.loads((folder / "tiny.json").read_text())[3]
    assert env.reset(**row) == ""  # the tool SFT's prompt, word for word
    with Image.open(folder / row["images"][0]) as own:
        assert ImageChops.difference(env.image, own.convert("RGB")).getbbox() is None
    with pytest.raises(qconfig.ConfigError, match=r"data\.tiny_task='tool_questions' is a conversation task; train\.objective='dpo'"):
        qconfig.load(overrides=["train.objective=dpo", "data.tiny_task=tool_questions"])


def test_tiny_tool_schemas_are_the_agentic_tools_json_schemas():
    from transformers.utils import get_json_schema

    from qwenkit.model.tiny.agentic import ShapesZoom, shape_colour

    assert SCHEMAS == [get_json_schema(shape_colour), get_json_schema(ShapesZoom().zoom)]


def test_data_check_counts_the_tool_turns_and_shows_a_row_with_its_responses_unlearned(media, capsys):
    from qwenkit.cli import main as cli_main

    rows = [cases()["swift"][0], cases()["sharegpt"][0], {"messages": [USER, ANSWER]}]
    (media / "rows.json").write_text(json.dumps(rows))
    code = cli_main(["data", "check", str(media / "rows.json"), "data.max_length=4096", f"data.cache_dir={media / 'c'}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert ("tool rows: 2; tools defined (rows): shape_colour (2), zoom (2); 5 calls in 3 replies, 4 tool responses "
            "(never learned)") in out  # fmt: skip
    example = out.split("tool row example (")[1]
    assert example.startswith(f"{media / 'rows.json'}: row 0;")
    assert "<|image_pad|>x" in example and "... (" in example  # pads counted, the tools block cut
    shown = "\n".join(line[2:] for line in example.splitlines()[1:] if line.startswith("  "))
    assert re.findall(r"\[\[(.*?)\]\]", shown, re.S) == [t + "<|im_end|>" for t in CALL_TEXT["hermes"]]
    assert "<|im_start|>user\n<tool_response>\na red square\n</tool_response>" in shown


@pytest.mark.slow
def test_the_tiny_tool_sft_recipe_trains_through_qwenkit_train(tmp_path):
    """params/tiny_tool_sft_cpu.yaml through `qwenkit train` (2 gloo ranks, 2 steps): the tool rows of every layout
    are read (none bad), trained on, and the held-out answers after the tool's response are generated and scored."""
    import subprocess
    import sys

    from multiproc import free_port

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "qwenkit.cli", "train", "--config", "params/tiny_tool_sft_cpu.yaml",
                           "--master-port", str(free_port()), "train.steps=2", "data.tiny_samples=12",
                           "data.tiny_eval_samples=4", "train.eval_samples=4", "train.eval_every=2",
                           "train.eval_accuracy_every=2", f"train.output_dir={out}"],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (out / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
    losses = [r["value"] for r in rows if r["metric"] == "loss"]
    assert len(losses) == 2 and all(0 < v < 20 for v in losses)
    replies = [json.loads(line) for line in (out / "eval" / "step-000002.jsonl").read_text().splitlines()]
    assert len(replies) == 4 and all(r["reference"].startswith("It is ") for r in replies)
