"""qwenkit.data.conversation: a row's turns checked before they are templated: placeholders against the
media, roles, turn order, an assistant reply to learn; each bad row named by file, row and reason."""

import pytest

from data.test_report import good_row, only_bad, write_set


@pytest.mark.parametrize(
    "content, images, detail",
    [
        ("<image><image>Compare.", ["ok.png"], "2 <image> placeholders but 1 image"),
        ("Describe.", ["ok.png"], "0 <image> placeholders but 1 image"),
        ("<image>Describe.", [], "1 <image> placeholder but 0 images"),
    ],
)
def test_placeholder_count_differs_from_images(tmp_path, processor, content, images, detail):
    row = {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Ok."}],
        "images": images,
    }
    assert detail in only_bad(write_set(tmp_path, row), processor, "image_count")


def test_placeholder_outside_user_message(tmp_path, processor):
    row = {
        "messages": [{"role": "user", "content": "Draw."}, {"role": "assistant", "content": "<image>"}],
        "images": ["ok.png"],
    }
    assert "message 1 (assistant)" in only_bad(write_set(tmp_path, row), processor, "image_count")


def test_unknown_role(tmp_path, processor):
    row = good_row()
    row["messages"].insert(1, {"role": "robot", "content": "{}"})
    assert "message 1 has role 'robot'" in only_bad(write_set(tmp_path, row), processor, "bad_role")


@pytest.mark.parametrize(
    "roles, detail",
    [
        (["assistant", "user", "assistant"], "message 0 is from assistant, expected user"),
        (["user", "user", "assistant"], "message 1 is from user, expected assistant"),
        (["user", "assistant", "user"], "the last message (2) is from user"),
        (["user", "system", "assistant"], "message 1 is a system message"),
    ],
)
def test_wrong_turn_order(tmp_path, processor, roles, detail):
    row = {"messages": [{"role": r, "content": f"{r} text"} for r in roles]}
    assert detail in only_bad(write_set(tmp_path, row), processor, "turn_order")


def test_no_assistant_reply(tmp_path, processor):
    row = {"messages": [{"role": "user", "content": "Anyone?"}]}
    only_bad(write_set(tmp_path, row), processor, "no_reply")


@pytest.mark.parametrize("reply", ["", "  \n", None])
def test_empty_assistant_reply(tmp_path, processor, reply):
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]}
    assert "message 1 is an empty assistant reply" in only_bad(
        write_set(tmp_path, row), processor, "empty_reply"
    )
