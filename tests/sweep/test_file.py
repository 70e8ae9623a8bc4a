"""qwenkit.sweep.file: a sweep file's trials (override sets x grid x seeds), their names, and every
problem of every trial refused before any run."""

from __future__ import annotations

import pytest
import yaml

from qwenkit import config as qconfig
from qwenkit import sweep
from sweep.sweeps import ROOT, SMALL, run_qwenkit, write_sweep


def test_trials_are_override_sets_times_grid_times_seeds(tmp_path):
    s = sweep.load(write_sweep(tmp_path, trials=[{"loss.chunk": True}, ["loss.chunk=false"]],
                          grid={"train.lr": [0.001, 0.003]}, seeds=[1, 2]), tmp_path / "out")  # fmt: skip
    assert len(s.trials) == 2 * 2 * 2
    assert [t.name for t in s.trials[:4]] == ["chunkTrue-lr0.001-seed1", "chunkTrue-lr0.001-seed2",
                                              "chunkTrue-lr0.003-seed1", "chunkTrue-lr0.003-seed2"]  # fmt: skip
    t = s.trials[5]
    assert t.varied == {"loss.chunk": False, "train.lr": 0.001, "train.seed": 2}
    assert (t.cfg.loss.chunk, t.cfg.train.lr, t.cfg.train.seed, t.cfg.train.steps) == (False, 0.001, 2, 4)
    assert t.output_dir == (tmp_path / "out" / t.name).resolve() and t.cfg.train.resume == "auto"
    assert s.varied_keys == ["loss.chunk", "train.lr", "train.seed"]


@pytest.mark.parametrize("value", [0.003, 1e-05, True, "x y", [1, 2], None])
def test_override_text_parses_back_to_the_value(value):
    key, text = sweep.override_text("a.b", value).split("=", 1)
    assert yaml.safe_load(text) == value


def test_sweep_files_are_read_as_configs_are(tmp_path):
    # YAML 1.1 (yaml.safe_load) reads `off` as False and `1e-4` as a string; the config loader does not
    path = tmp_path / "sweep.yaml"
    path.write_text(f"base: {ROOT / 'params' / 'tiny_cpu.yaml'}\noverrides: [{', '.join(SMALL)}]\n"
                    "grid: {model.fused_ops: [off], train.lr: [1e-4]}\ntrials: [[train.warmup_steps=off]]\n")
    with pytest.raises(sweep.SweepError, match="train.warmup_steps"):  # an int field: `off` stays a string
        sweep.load(path, tmp_path / "out")
    path.write_text(path.read_text().replace("trials: [[train.warmup_steps=off]]", "trials: [[loss.chunk=off]]"))
    (t,) = sweep.load(path, tmp_path / "out").trials
    assert (t.cfg.model.fused_ops, t.cfg.train.lr, t.cfg.loss.chunk) == ("off", 1e-4, False)
    assert t.varied == {"loss.chunk": "off", "model.fused_ops": "off", "train.lr": 1e-4}


def test_names_keep_keys_apart_when_their_last_parts_clash():
    assert sweep.trial_name({"train.lr": 0.003, "train.seed": 1}) == "lr0.003-seed1"
    assert sweep.trial_name({"a.r": 1, "b.r": 2}) == "a_r1-b_r2"
    assert sweep.trial_name({"model.freeze": ["model.visual"]}) == "freezemodel.visual"
    assert sweep.trial_name({}) == "base"


def test_a_bad_value_in_one_trial_fails_the_sweep_before_any_run(tmp_path, tiny_path):  # tiny_path: the checkpoint is written, its progress bar is not in stderr
    path = write_sweep(tmp_path, trials=[{"train.lr": 0.001}, {"train.lr": 0.002}, {"train.warmup_steps": -1}])
    out = tmp_path / "out"
    proc = run_qwenkit("sweep", "run", str(path), "--out", str(out))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "trial 3 (warmup_steps-1)" in lines[0] and "train.warmup_steps must be >= 0" in lines[0]
    assert not out.exists()  # nothing ran, nothing was written


def test_an_unknown_key_names_the_trial_and_the_key(tmp_path, tiny_path):
    with pytest.raises(sweep.SweepError, match=r"trial 2 \(lrr0.1\): unknown key 'train.lrr'; did you mean 'train.lr'"):
        sweep.load(write_sweep(tmp_path, trials=[{"train.lr": 0.1}, {"train.lrr": 0.1}]), tmp_path / "out")
    with pytest.raises(sweep.SweepError, match="unknown key 'grids'"):
        sweep.load(write_sweep(tmp_path, grids={"train.lr": [1]}), tmp_path / "out")
    with pytest.raises(sweep.SweepError, match="seeds must be a non-empty list of integers"):
        sweep.load(write_sweep(tmp_path, seeds=["1"]), tmp_path / "out")
    with pytest.raises(sweep.SweepError, match="trials 1 and 2 are both 'lr0.1'"):
        sweep.load(write_sweep(tmp_path, trials=[{"train.lr": 0.1}, {"train.lr": 0.1}]), tmp_path / "out")


def test_a_trial_folder_run_with_another_config_is_refused(tmp_path):
    s = sweep.load(write_sweep(tmp_path, grid={"train.lr": [0.001]}), tmp_path / "out")
    qconfig.write_config(s.trials[0].cfg, s.trials[0].output_dir)
    sweep.load(write_sweep(tmp_path, grid={"train.lr": [0.001]}), tmp_path / "out")  # the same config: fine
    with pytest.raises(sweep.SweepError, match="was run with another config"):
        sweep.load(write_sweep(tmp_path, grid={"train.lr": [0.001]}, overrides=[*SMALL, "train.steps=5"]), tmp_path / "out")


def test_a_trial_folder_of_an_older_qwenkit_is_the_same_run_when_only_new_keys_are_missing(tmp_path):
    """A qwenkit upgrade adds settings (``grpo.rollout_dtype`` in this one): a trial folder written before it
    lacks them, and ran with what their defaults do, so it is the run the sweep file gives; a value it holds
    that differs is still another run, and so is a key this qwenkit no longer knows."""
    s = sweep.load(write_sweep(tmp_path, grid={"train.lr": [0.001]}), tmp_path / "out")
    written = qconfig.write_config(s.trials[0].cfg, s.trials[0].output_dir)
    older = yaml.safe_load(written.read_text())
    del older["grpo"]["rollout_dtype"]
    written.write_text(yaml.safe_dump(older, sort_keys=False))
    sweep.load(write_sweep(tmp_path, grid={"train.lr": [0.001]}), tmp_path / "out")
    older["train"]["steps"] += 1
    written.write_text(yaml.safe_dump(older, sort_keys=False))
    with pytest.raises(sweep.SweepError, match="was run with another config"):
        sweep.load(write_sweep(tmp_path, grid={"train.lr": [0.001]}), tmp_path / "out")
    older["train"]["steps"] -= 1
    older["grpo"]["a_removed_setting"] = 1
    written.write_text(yaml.safe_dump(older, sort_keys=False))
    with pytest.raises(sweep.SweepError, match="was run with another config"):
        sweep.load(write_sweep(tmp_path, grid={"train.lr": [0.001]}), tmp_path / "out")
