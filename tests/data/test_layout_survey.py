"""qwenkit.data.layout_survey: the layouts of a dataset's files and the keys no reader reads, as
``qwenkit data check`` and notebook 01 print them."""

from data.test_layouts import GOOD, write_jsonl
from qwenkit.data import layout_survey
from qwenkit.data.reader import JsonSource


def test_survey_counts_rows_no_layout_reads(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, {"text": "hi"}])
    (found,) = layout_survey.survey([JsonSource(path)])
    assert found.lines() == [f"layout: llava (image/conversations), 1 row; no layout, 1 row in {path}"]


def test_ignored_keys_are_the_keys_the_layout_does_not_read():
    row = {**GOOD, "id": 7, "source": "web", "conversations": [{**GOOD["conversations"][0], "weight": 0.5}, GOOD["conversations"][1]]}
    assert layout_survey.ignored_keys(row, "llava") == {"source", "conversations[].weight"}  # "id" is read: it names rows
    typed = {"messages": [{"role": "user", "content": [{"type": "video", "video": ["a.jpg", "b.jpg"], "fps": 2, "crop": 1},
                                                       {"type": "text", "text": "Hi?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]}]}  # fmt: skip
    assert layout_survey.ignored_keys(typed, "typed") == {"content[].crop"}  # a frame list's fps is read


def test_describe_prints_one_summary_per_file(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [GOOD, GOOD])
    second = write_jsonl(tmp_path / "b.jsonl", [{**GOOD, "source": "web"}])
    assert layout_survey.describe([JsonSource(first), JsonSource(second)]).splitlines() == [
        f"layout: llava (image/conversations), 2 rows in {first}",
        f"layout: llava (image/conversations), 1 row in {second}",
        "  keys not read (ignored): source",
    ]
