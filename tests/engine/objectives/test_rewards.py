"""GRPO's rewards: the format and IoU rewards by hand, the answer metrics on the answer tag, a user's
``module:function`` reward with its row's columns, the weighted sum, and the one-line refusal of a
value that is not a finite number."""

import math
import textwrap

import pytest
import torch
from conftest import FAMILIES

from qwenkit.engine.objectives import rewards
from qwenkit.model.families import registry as families


def _one(name, prediction, reference, box_units="pixels", tags=("think", "answer"), **row):
    (reward,) = rewards.resolve([name], box_units, tags).values()
    return reward(prediction, reference, **row)


@pytest.mark.parametrize(
    "text, want",
    [
        ("<think>red, round</think><answer>red</answer>", 1.0),
        ("  <think>\nmulti\nline\n</think>\n<answer>red</answer>\n", 1.0),
        ("<answer>red</answer>", 0.0),  # no reasoning
        ("<think>a</think><answer>red</answer> trailing words", 0.0),
        ("<think>a<think>b</think><answer>red</answer>", 0.0),  # a tag twice
        ("<answer>red</answer><think>a</think>", 0.0),  # out of order
        ("red", 0.0),
    ],
)
def test_format_reward_by_hand(text, want):
    assert _one("format", text, "red") == want


def test_format_tags_are_settable():
    assert _one("format", "<reason>x</reason><final>y</final>", "y", tags=("reason", "final")) == 1.0
    assert _one("format", "<think>x</think><answer>y</answer>", "y", tags=("reason", "final")) == 0.0


def test_answer_metrics_score_the_answer_tag_when_there_is_one():
    assert _one("exact", "<think>it looks red</think><answer> Red </answer>", "red") == 1.0
    assert _one("exact", "<think>blue?</think><answer>blue</answer>", "<answer>red</answer>") == 0.0
    assert _one("exact", "red", "red") == 1.0  # no tag: the whole text
    assert _one("normalized", "<answer>two</answer>", "2") == 1.0
    assert _one("exact", "<answer>(B) a cat</answer>", "B") == 1.0  # multiple choice by the letter, as eval


def test_iou_by_hand_in_each_convention():
    # [0,0,10,10] vs [5,5,15,15]: intersection 25, union 175
    assert _one("iou", "the box is [0, 0, 10, 10]", "[5, 5, 15, 15]") == pytest.approx(25 / 175)
    assert _one("iou", '{"bbox_2d": [15, 15, 5, 5], "label": "cat"}', "[5,5,15,15]") == 1.0  # corners reordered
    assert _one("iou", "no box here", "[5, 5, 15, 15]") == 0.0
    # per-mille boxes are clamped to 0..1000: [900, 900, 1100, 1000] is [900, 900, 1000, 1000]
    assert _one("iou", "[900, 900, 1100, 1000]", "[900, 900, 1000, 1000]", box_units="per_mille") == 1.0
    assert _one("iou", "[900, 900, 1100, 1000]", "[900, 900, 1000, 1000]") == pytest.approx(0.5)  # pixels: not clamped
    with pytest.raises(ValueError, match=r"iou reward needs a box .* in the reference, got 'red'"):
        _one("iou", "[0, 0, 1, 1]", "red")


def test_every_family_names_its_box_convention():
    units = {name: families.get(name).box_units for name in FAMILIES}
    # Qwen2.5-VL grounds in absolute pixels of the resized image; Qwen3-VL and Qwen3.5 in 0-1000 of each side;
    # each Omni thinker as the VL generation its vision tower is
    assert units == {"qwen2_5_vl": "pixels", "qwen3_vl": "per_mille", "qwen3_vl_moe": "per_mille",
                     "qwen3_5": "per_mille", "qwen3_5_moe": "per_mille", "qwen4_exp": "per_mille", "qwen2_5_omni": "pixels",
                     "qwen3_omni_moe": "per_mille"}


def test_a_user_reward_gets_its_rows_columns_and_is_logged_under_its_name(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length_bonus(prediction, reference, **row):
            return len(prediction) / row["scale"]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    found = rewards.resolve(["exact", "my_rewards:length_bonus"], "pixels")
    assert list(found) == ["exact", "length_bonus"]
    per, total = rewards.score(found, [1.0, 0.5], ["red", "blue"], ["red", "red"],
                               [{"scale": 2}, {"scale": 4}], ["t.jsonl row 0", "t.jsonl row 1"])  # fmt: skip
    torch.testing.assert_close(per, torch.tensor([[1.0, 1.5], [0.0, 1.0]]))
    torch.testing.assert_close(total, torch.tensor([1.75, 0.5]))
    _, unweighted = rewards.score(found, [], ["red"], ["red"], [{"scale": 1}], ["t.jsonl row 0"])
    assert unweighted.tolist() == [4.0]


@pytest.mark.parametrize("value", [math.nan, -math.inf, None, "1"])
def test_a_reward_that_is_not_a_finite_number_names_the_reward_and_the_row(value):
    def broken(prediction, reference, **row):
        return value

    with pytest.raises(ValueError, match=r"^grpo\.rewards 'broken' returned .* on t\.jsonl row 7; it must return a float$|"
                                         r"^grpo\.rewards 'broken' returned .* on t\.jsonl row 7; a score must be a finite number$"):
        rewards.score({"broken": broken}, [], ["x"], ["y"], [{}], ["t.jsonl row 7"])


def test_a_reward_that_raises_names_the_reward_and_the_row_and_numpy_scalars_count():
    def raising(prediction, reference, **row):
        raise KeyError("box")

    with pytest.raises(ValueError, match=r"^grpo\.rewards 'raising' raised KeyError: 'box' on t\.jsonl row 3$"):
        rewards.score({"raising": raising}, [], ["x"], ["y"], [{}], ["t.jsonl row 3"])
    numpy = pytest.importorskip("numpy")
    _, total = rewards.score({"np": lambda p, r, **row: numpy.float32(2.5)}, [], ["x"], ["y"], [{}], ["t.jsonl row 0"])
    assert total.tolist() == [2.5]  # any finite number: rewards are not bounded to [0, 1]


@pytest.mark.parametrize("value", [math.nan, None, "1", KeyError("box")])
def test_a_failed_reward_carries_what_reproduces_it(value):
    """The record a failed run writes to its folder: the reward, the row, the completion, its reference,
    the row's columns and the traceback of the reward's own error (its frame among them)."""
    def broken(prediction, reference, **row):
        if isinstance(value, Exception):
            raise value
        return value

    with pytest.raises(rewards.RewardError) as caught:
        rewards.score({"broken": broken}, [], ["fine", "x"], ["y", "z"], [{"k": 0}, {"k": 1}], ["row 0", "row 7"])
    record = caught.value.record
    assert {k: record[k] for k in ("reward", "row", "position", "completion", "reference", "columns")} == \
           {"reward": "broken", "row": "row 0", "position": 0, "completion": "fine", "reference": "y", "columns": {"k": 0}}
    assert record["error"] == str(caught.value) and "grpo.rewards 'broken'" in record["error"]
    assert "Traceback (most recent call last)" in record["traceback"]
    if isinstance(value, Exception):
        assert "in broken" in record["traceback"] and "KeyError: 'box'" in record["traceback"]


# A reward that fails in the middle of a GRPO run (issue 66): on rank 1 it raises, on rank 0 it returns a
# string, at its 9th completion: step 3's first, one step after the checkpoint of step 2 (written in the
# background with checkpoint.async: still in flight when the reward fails)
FLAKY = """
import os
CALLS = [0]
def flaky(prediction, reference, **row):
    CALLS[0] += 1
    if os.environ["RANK"] == "{rank}" and CALLS[0] >= 9:
        {fails}
    return 1.0
"""
FAILS = {"raises on rank 1": ("1", "raise ZeroDivisionError('no answer to divide by')", []),
         "returns a string on rank 0 (async checkpoints)": ("0", "return 'high'", ["checkpoint.async=true"])}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", FAILS)
def test_a_reward_failing_mid_run_stops_in_one_line_keeps_every_checkpoint_and_writes_what_failed(case, tmp_path):
    import json
    import os
    import subprocess

    from jobs import HANG, ROOT, checkpoints, train_cmd
    from multiproc import scaled

    from qwenkit.engine.run import events
    from qwenkit.rundir import RunDir

    rank, fails, extra = FAILS[case]
    (tmp_path / "flaky_reward.py").write_text(FLAKY.format(rank=rank, fails=fails))
    out = tmp_path / "run"
    cmd = train_cmd(out, "train.objective=grpo", "train.micro_batch_size=2", "grpo.num_generations=2",
                    "grpo.max_new_tokens=3", "grpo.rewards=[flaky_reward:flaky]", "checkpoint.every=2", *extra, steps=6)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(HANG))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("qwenkit train:") and "qwenkit.torchrun" not in line]
    (line,) = ours  # one line: no echo of a lost peer, no torchrun summary, no launcher afterword
    said = "raised ZeroDivisionError: no answer to divide by" if rank == "1" else "returned 'high' (str)"
    assert line.startswith(f"qwenkit train: grpo.rewards 'flaky' {said} on row "), line
    assert checkpoints(out) == [2] and not list((out / "checkpoints").glob(".tmp-*"))  # the save in flight completed
    path = RunDir(out).reward_failure
    assert f"(rank {rank}, step 3); its row, completion and traceback (and any other rank's) are in {path}; fix the " \
           "reward, then run the same command again: train.resume=auto goes on from the newest checkpoint" in line, line
    (record,) = json.loads(path.read_text())
    assert (record["rank"], record["step"], record["reward"]) == (int(rank), 3, "flaky")
    file, _, row = record["where"].partition(": row ")  # the row's file and its row there, as a bad row is named
    assert file.endswith("tiny.json") and int(row) == record["index"], record["where"]
    assert isinstance(record["completion"], str) and record["reference"] and "messages" in record["columns"]
    assert ("ZeroDivisionError" in record["traceback"]) == (rank == "1")
    failed = [e for e in events.read(out) if e["event"] == "failed"]
    assert {e["rank"] for e in failed} == {0, 1} and all(e["input"] and e["error"] == "RewardsStopped" for e in failed)


@pytest.mark.parametrize("max_new_tokens, buffer", [(8, 3), (20, 20), (16, 1), (512, 128)])
def test_overlong_equals_trls_soft_overlong_punishment(max_new_tokens, buffer):
    """DAPO's Eq. 13 as TRL's ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``: 0 up to
    ``L - C`` tokens, linearly down to -1 at ``L``, at every length (and past ``L``, where it is -1)."""
    from trl.rewards import get_soft_overlong_punishment

    lengths = range(max_new_tokens + 3)
    ids = [[7] * n for n in lengths]
    want = get_soft_overlong_punishment(max_new_tokens, buffer)(ids)
    (reward,) = rewards.resolve(["overlong"], "pixels", max_new_tokens=max_new_tokens, overlong_buffer=buffer).values()
    assert [reward("text", "ref", completion_ids=c) for c in ids] == pytest.approx(want, abs=0, rel=1e-12)
    assert want[max_new_tokens - buffer] == 0 and want[max_new_tokens] == -1


def test_rewards_get_the_completions_ids_and_overlong_needs_its_buffer():
    """The objective hands every reward the completion's ``completion_ids`` beside the row's columns
    (TRL's keyword); ``score`` passes them on as it passes the columns."""
    seen = []

    def lengths(prediction, reference, **row):
        seen.append(row)
        return float(len(row["completion_ids"]))

    found = rewards.resolve(["overlong"], "pixels", max_new_tokens=4, overlong_buffer=2) | {"lengths": lengths}
    rows = [{"scale": 1, "completion_ids": [1, 2, 3]}, {"scale": 2, "completion_ids": [1]}]
    per, _ = rewards.score(found, [], ["a", "b"], ["r", "r"], rows, ["t.jsonl row 0", "t.jsonl row 1"])
    torch.testing.assert_close(per, torch.tensor([[-0.5, 3.0], [0.0, 1.0]]))
    assert seen == rows
    with pytest.raises(ValueError, match=r"grpo\.overlong_buffer must be in \[1, grpo\.max_new_tokens=4\], got 0"):
        rewards.resolve(["overlong"], "pixels", max_new_tokens=4)
