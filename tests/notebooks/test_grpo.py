"""Notebook 02's GRPO branch on a synthetic run folder: completion records read with a step or a
rollout number, early vs late groups paired by hand, figures drawn from the metric files, the headline."""

import json

import pytest
import yaml

from qwenkit.engine.objectives.grpo import SAMPLE_FILE
from qwenkit.notebooks import grpo, results

REWARDS = {1: 0.25, 2: 0.5, 3: 0.75}  # reward per step; reward_std 0.1 every step


def _record(at: dict, index: int, completion: str, exact: float, fmt: float) -> dict:
    return {**at, "epoch": 0, "index": index, "completion": completion, "reference": f"ref {index}",
            "rewards": {"exact": exact, "format": fmt}, "advantage": 0.0, "truncated": False}  # fmt: skip


def _run(path, key="rollout", kl0=0.0):
    """Three rollouts on rank 0: rows 7 and 9, then 8 (once), then 7 again; rollout 1 was written
    twice (a resumed run made it again after rollout 2 had been written: its first writing is stale)."""
    (path / "metrics").mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 3},
                                                      "grpo": {"rewards": ["exact", "format"], "reward_weights": [1.0, 0.5]}}))  # fmt: skip
    at = (lambda r: {"rollout": r}) if key == "rollout" else (lambda r: {"step": r + 1})
    rows = [
        _record(at(0), 7, "a blue one", 0.0, 1.0), _record(at(0), 7, "red", 1.0, 0.0),
        _record(at(0), 9, "two", 0.0, 0.0), _record(at(0), 9, "three", 0.0, 0.0),
        _record(at(1), 8, "stale", 0.0, 0.0), _record(at(1), 8, "stale", 0.0, 0.0),
        _record(at(2), 7, "red", 1.0, 0.0), _record(at(2), 7, "red", 1.0, 1.0),
        _record(at(1), 8, "square", 1.0, 0.0), _record(at(1), 8, "circle", 0.0, 0.0),
    ]  # fmt: skip
    if key == "step":  # k: a line's place in its step's write, as GrpoObjective.log numbers them
        for i, r in enumerate(rows):
            r["k"] = rows[i - 1]["k"] + 1 if i and rows[i - 1]["step"] == r["step"] else 0
    (path / "metrics" / SAMPLE_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    metric_rows = []
    for step, reward in REWARDS.items():
        for name, value in {"reward": reward, "reward_std": 0.1, "rewards/exact/mean": reward, "rewards/format/mean": 0.0,
                            "kl": kl0 if step == 1 else 0.01 * step, "entropy": 1.0 / step,
                            "completions/mean_length": 4.0, "frac_reward_zero_std": 0.5,
                            "step_time": 2.0, "rollout_time": 1.5 if step != 2 else 0.0}.items():  # fmt: skip
            metric_rows.append({"metric": name, "x": step, "value": value, "rank": 0})
    (path / "metrics" / "rank-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metric_rows))
    return path


@pytest.mark.parametrize("key", ["rollout", "step"])
def test_records_are_read_by_step_or_rollout_and_a_rewritten_rollout_keeps_its_last_writing(tmp_path, key):
    name, rows = grpo.completions(_run(tmp_path, key))
    assert name == key
    first = 0 if key == "rollout" else 1
    assert [r["x"] - first for r in rows] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [r["completion"] for r in rows if r["index"] == 8] == ["square", "circle"]


def test_changed_pairs_each_prompt_seen_twice_with_weighted_rewards_by_hand(tmp_path):
    rows = grpo.changed_rows(_run(tmp_path))
    assert [r["index"] for r in rows] == [7]  # 9 and 8 were rolled out once
    r = rows[0]
    assert (r["early"]["x"], r["late"]["x"], r["reference"], r["x_name"]) == (0, 2, "ref 7", "rollout")
    # weights exact 1, format 0.5
    assert [c["reward"] for c in r["early"]["completions"]] == [0.5, 1.0] and r["early"]["reward"] == 0.75
    assert [c["reward"] for c in r["late"]["completions"]] == [1.0, 1.5] and r["late"]["reward"] == 1.25
    assert r["change"] == 0.5
    assert grpo.reward_weights(tmp_path) == {"exact": 1.0, "format": 0.5}


def test_figures_draw_the_logged_series(tmp_path):
    run = _run(tmp_path / grpo.GRPO)
    band, reward, exact, fmt = grpo.reward_figure(run).data
    assert list(reward.x) == [1, 2, 3] and list(reward.y) == list(REWARDS.values())
    assert list(band.y) == pytest.approx([0.35, 0.6, 0.85, 0.65, 0.4, 0.15])  # reward + std, then - std backwards
    assert (exact.name, fmt.name) == ("rewards/exact/mean", "rewards/format/mean")
    panels = grpo.diagnostics_figure(run).data
    assert [p.name for p in panels] == list(grpo.DIAGNOSTICS)
    assert list(panels[1].y) == pytest.approx([1.0, 0.5, 1 / 3])  # entropy
    rollout, rest = grpo.time_figure(run).data
    assert list(rollout.y) == [1.5, 0.0, 1.5] and list(rest.y) == [0.5, 2.0, 0.5]  # step 2 reused its rollout
    assert "rollout 50% of it" in grpo.time_figure(run).layout.title.text  # 3.0 s of 6.0 s
    assert len(grpo.figures(tmp_path)) == 3


def test_save_adds_the_run_to_the_notebooks_metrics(tmp_path):
    run = _run(tmp_path / grpo.GRPO)
    results.write_metrics(tmp_path, "02_sharded_training", "2-rank FSDP2 run", True, steps=8)
    grpo.save_changed(tmp_path, run)
    v = grpo.save(tmp_path, run)
    doc = results.read_metrics(tmp_path)
    assert doc["passed"] and doc["values"] == v and v["steps"] == 8
    assert (v["grpo_steps"], v["grpo_first_reward"], v["grpo_last_reward"], v["grpo_changed_prompts"]) == (3, 0.25, 0.75, 1)
    assert v["grpo_rewards"] == ["exact", "format"] and v["grpo_last_exact"] == 0.75 and v["grpo_first_kl"] == 0.0
    assert v["grpo_reward_rose"] and v["grpo_rollout_share"] == pytest.approx(0.5)
    assert doc["summary"] == ("2-rank FSDP2 run; GRPO 3 steps: mean reward 0.25 (first 1 steps) -> 0.75 (last 1), "
                              "1 prompts seen early and late")  # fmt: skip
    assert "grpo-completions" in grpo.changed_table(tmp_path).data


def test_first_and_last_rewards_are_means_over_a_fifth_of_the_steps(tmp_path):
    run = _run(tmp_path / grpo.GRPO)
    rows = [{"metric": name, "x": step, "value": float(step), "rank": 0} for step in range(1, 11)
            for name in ("reward", "rewards/exact/mean")]  # fmt: skip
    (run / "metrics" / "rank-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    v = grpo.values(run, [])
    assert (v["grpo_reward_window"], v["grpo_first_reward"], v["grpo_last_reward"]) == (2, 1.5, 9.5)
    assert (v["grpo_first_exact"], v["grpo_last_exact"], v["grpo_first_kl"]) == (1.5, 9.5, None)  # no kl: beta 0


def test_a_run_whose_prompts_never_came_back_passes_and_says_why_none_changed(tmp_path):
    run = _run(tmp_path / grpo.GRPO)
    results.write_metrics(tmp_path, "02_sharded_training", "run", True)
    results.write_jsonl([], tmp_path / grpo.CHANGED)  # a run shorter than an epoch of its data
    assert grpo.save(tmp_path, run)["grpo_changed_prompts"] == 0 and results.read_metrics(tmp_path)["passed"]
    assert grpo.NONE_AGAIN in grpo.changed_table(tmp_path).data


def test_save_fails_when_the_first_step_did_not_start_at_the_reference(tmp_path):
    run = _run(tmp_path / grpo.GRPO, kl0=0.2)
    results.write_metrics(tmp_path, "02_sharded_training", "run", True)
    grpo.save_changed(tmp_path, run)
    assert grpo.save(tmp_path, run)["grpo_first_kl"] == 0.2 and not results.read_metrics(tmp_path)["passed"]


def test_a_grpo_config_that_is_not_grpo_is_refused_before_any_run(tmp_path):
    sft = tmp_path / "sft.yaml"
    sft.write_text("train: {objective: sft}\n")
    with pytest.raises(ValueError, match=f"grpo_config={sft}: train.objective is 'sft', not grpo"):
        grpo.check_config(sft, [])
    grpo.check_config(sft, ["train.objective=grpo"])
