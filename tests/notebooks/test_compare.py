"""Notebook 05's computations on hand-made runs: ranking direction, varied keys from the configs,
line styles by varied key, and the run-folder checks."""

from __future__ import annotations

import json

import pytest
import yaml

from qwenkit.notebooks import compare


def test_ranking_puts_the_best_first_in_each_metrics_direction():
    finals = {"a": {"eval_accuracy": 0.2, "eval_loss": 1.0}, "b": {"eval_accuracy": 0.5, "eval_loss": 3.0},
              "c": {"eval_accuracy": None, "eval_loss": 2.0}}  # fmt: skip
    assert compare.ranking(finals, "eval_accuracy") == ["b", "a", "c"]  # higher is better; missing last
    assert compare.ranking(finals, "eval_loss") == ["a", "c", "b"]  # lower is better
    with pytest.raises(ValueError, match="rank_by='accuracy': expected one of"):
        compare.ranking(finals, "accuracy")


def _run(folder, lr, seed):
    folder.mkdir(parents=True)
    cfg = {"train": {"lr": lr, "seed": seed, "output_dir": str(folder), "steps": 4}, "model": {"path": "tiny"}}
    (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    return folder


def test_varied_keys_come_from_the_configs_and_set_colour_and_dash(tmp_path):
    folders = [_run(tmp_path / n, lr, s) for n, lr, s in (("a", 0.1, 1), ("b", 0.1, 2), ("c", 0.01, 1))]
    runs = compare.collect(compare.run_folders(None, folders))
    assert [r["varied"] for r in runs] == [{"train.lr": 0.1, "train.seed": 1}, {"train.lr": 0.1, "train.seed": 2},
                                           {"train.lr": 0.01, "train.seed": 1}]  # output_dir left out  # fmt: skip
    compare.save(tmp_path / "out", runs, "eval_loss")
    doc = json.loads((tmp_path / "out" / compare.RUNS).read_text())
    style = compare.styles(doc)  # colour by the learning rate, dash by the seed
    assert style["a"]["colour"] == style["b"]["colour"] != style["c"]["colour"]
    assert style["a"]["dash"] == style["c"]["dash"] != style["b"]["dash"]
    swapped = compare.styles(doc, colour_by="train.seed", dash_by="train.lr")
    assert swapped["a"]["colour"] == swapped["c"]["colour"] != swapped["b"]["colour"]
    with pytest.raises(ValueError, match="'train.steps' is not a varied key"):
        compare.styles(doc, colour_by="train.steps")
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert not metrics["passed"]  # runs without metrics: nothing to rank by


def test_run_folders_without_a_config_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.yaml"):
        compare.run_folders(None, [tmp_path])
    with pytest.raises(FileNotFoundError, match="no ledger"):
        compare.run_folders(tmp_path, [])
