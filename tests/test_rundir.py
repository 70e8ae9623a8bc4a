"""qwenkit.rundir: a run folder's file names, checked against what the writers put there (the
launcher's config, the trainer's parameter counts through the registry)."""

from __future__ import annotations

import json

from conftest import build_model

from qwenkit import config as qconfig
from qwenkit.model.families import build as registry
from qwenkit.rundir import RunDir


def test_a_folder_is_a_run_once_the_launcher_wrote_its_config(tmp_path):
    run = RunDir(tmp_path / "run")
    assert not run.is_run()
    written = qconfig.write_config(qconfig.load(), run.path)
    assert written == run.config and run.is_run()
    assert run.rank_log(3) == run.path / "logs" / "rank-00003.log"
    assert run.metrics.name == "metrics" and run.checkpoints.name == "checkpoints"
    assert RunDir(str(run.path)) == run  # a str or a Path names the same folder


def test_parameter_counts_read_back_what_the_registry_counted(tmp_path):
    run = RunDir(tmp_path)
    assert run.parameter_counts() is None
    model = build_model(freeze=["model.visual"])
    counts = registry.parameter_counts(model)
    run.parameters.write_text(json.dumps(counts, indent=1) + "\n")  # as the trainer writes it
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert run.parameter_counts() == (total, trainable) and 0 < trainable < total
