"""qwenkit.engine.checkpoints.resume: which checkpoint a start resumes, and may it. ``train.stop_after``'s loop to the end,
another data order refused, damaged checkpoints (truncated, flipped bytes, bad markers) named or skipped, on
real ``qwenkit train`` jobs (2 gloo ranks, :mod:`jobs`) and on hand-made checkpoint folders (issues #23, #34)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from jobs import EXIT_RESUMABLE, checkpoints, invocation, refused, steps, train

from qwenkit import config as qconfig
from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.checkpoints import resume
from qwenkit.engine.run import events


@pytest.mark.slow
def test_stop_after_loop_to_the_end_and_damaged_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"

    def run(*overrides, nproc=2):
        """One invocation into ``out``; returns it and the events it wrote."""
        before = len(events.read(out))
        proc = train(out, "train.stop_after=2", "checkpoint.keep_last=3", *overrides, nproc=nproc, steps=4)
        return proc, invocation(out, before)

    first, written = run()
    assert first.returncode == EXIT_RESUMABLE, first.stderr[-3000:]
    assert "run the same command again to continue" in first.stderr and checkpoints(out) == [2]
    stopped = events.last(written, "stopped")
    assert steps(written) == [1, 2] and (stopped["reason"], stopped["exit_code"]) == ("stop_after", EXIT_RESUMABLE)
    second, written = run()
    assert second.returncode == 0, second.stderr[-3000:]
    assert events.resumed_step(written) == 2 and steps(written) == [3, 4] and checkpoints(out) == [2, 4]
    assert events.last(written, "stopped")["reason"] == "completed"
    # a complete run started again trains nothing; on 1 rank, so it is also a resume on another world size
    third, written = run(nproc=1)
    assert third.returncode == 0 and "training is complete: at step 4 of train.steps=4" in third.stderr
    assert events.resumed_step(written) == 4 and steps(written) == [], written
    assert events.last(written, "stopped")["reason"] == "completed" and checkpoints(out) == [2, 4]

    # another data order (train.seed): refused by the launcher from COMPLETE.json in one line,
    # nothing started, the run's record (config.yaml) left as the run wrote it
    # (the launcher in this process: jobs.refused)
    record, before = (out / "config.yaml").read_text(), len(events.read(out))
    capsys.readouterr()
    assert refused(out, "train.stop_after=2", "checkpoint.keep_last=3", "train.seed=2", steps=4) == 2
    other = capsys.readouterr()
    refusal = [line for line in other.err.splitlines() if "cannot resume" in line]
    assert len(refusal) == 1 and "train.seed saved 42, now 2: set train.seed=42 to continue" in refusal[0], other.err
    assert "torchrun" not in other.out and "Traceback" not in other.err
    assert (out / "config.yaml").read_text() == record and invocation(out, before) == []
    # a start that fails inside the ranks (another tiny set: only the sampler's state tells) leaves the record
    # byte for byte too, and qwenkit export of the run still works from it
    failed, _ = run("data.tiny_samples=24")
    assert failed.returncode == 1 and "num_samples" in failed.stderr, failed.stderr[-3000:]
    assert (out / "config.yaml").read_text() == record
    exported = subprocess.run([sys.executable, "-m", "qwenkit.cli", "export", str(out), str(out.parent / "hf")],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    assert exported.returncode == 0 and (out.parent / "hf" / "config.json").is_file(), exported.stderr[-3000:]

    root = ckpt.checkpoint_root(out)
    # a truncated file, asked for by path: one line naming checkpoint and file, offering step 2
    truncated = root / "step-00000004" / "__1_0.distcp"
    saved = truncated.read_bytes()
    truncated.write_bytes(saved[: len(saved) // 2])
    assert refused(out, "checkpoint.keep_last=3", f"train.resume={root / 'step-00000004'}", steps=6) == 2
    named = capsys.readouterr().err
    assert "__1_0.distcp is" in named and str(root / "step-00000004") in named
    assert f"the newest older complete checkpoint is {str(root / 'step-00000002')!r}" in named
    assert "PytorchStreamReader" not in named and "Traceback" not in named
    truncated.write_bytes(saved)

    # 64 flipped bytes inside a .distcp (same size: only the checksum sees it): auto falls back
    flipped = root / "step-00000004" / "__0_0.distcp"
    data = bytearray(flipped.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    flipped.write_bytes(bytes(data))
    fallback, written = run("train.steps=6", "train.stop_after=0")
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert "__0_0.distcp fails its checksum" in fallback.stderr and "falling back" in fallback.stderr
    resumed = events.last(written, "resumed")
    assert (resumed["step"], resumed["checkpoint"]) == (2, str(root / "step-00000002"))
    assert steps(written) == [3, 4, 5, 6]
    assert checkpoints(out) == [2, 6] and list(root.glob("damaged-step-00000004-*"))


def test_damaged_markers_are_named_and_auto_skips_them(tmp_path):
    root = ckpt.checkpoint_root(tmp_path)
    for step, marker in [(2, {"step": 2}), (4, ""), (6, "{not json")]:
        ckpt.step_dir(root, step).mkdir(parents=True)
        text = marker if isinstance(marker, str) else json.dumps(marker)
        (ckpt.step_dir(root, step) / ckpt.COMPLETE).write_text(text)
    decision = resume.decide(qconfig.load(overrides=[f"train.output_dir={tmp_path}"]), None)
    assert decision.path == ckpt.step_dir(root, 2)
    assert [(p.name, re.sub(r".*COMPLETE.json is ", "", why)[:5]) for p, why in decision.skipped] == [
        ("step-00000006", "not v"), ("step-00000004", "empty")
    ]
    with pytest.raises(ckpt.CheckpointError, match=r"COMPLETE.json is empty; the newest older complete checkpoint is .*step-00000002"):
        resume.decide(qconfig.load(overrides=[f"train.output_dir={tmp_path}", f"train.resume={ckpt.step_dir(root, 4)}"]), None)


# issue 46: what a checkpoint holds (STATE_KEYS) and reads is compared before any process starts
SAVED = ["data.tiny_samples=16", "parallel.device=cpu", "train.resume=auto"]


@pytest.mark.parametrize("changed, named", [
    (["model.name=qwen3_vl"], "model.name saved 'qwen2_5_vl', now 'qwen3_vl'"),
    (["model.tie_word_embeddings=true"], "model.shape (tie_word_embeddings saved False, now True in model.path's config.json)"),
    (["train.objective=dpo"], "train.objective saved 'sft', now 'dpo'"),
    (["lora.r=8"], "lora.r saved 0, now 8"),
    (["data.eval_fraction=0.25"], "data.eval_fraction saved 0.0, now 0.25"),
    (["data.shuffle=false"], "data.shuffle saved True, now False"),
    (["data.path=FILE"], "the saved run read the tiny set or a datasets folder, this one reads JSON files"),
])  # fmt: skip
def test_a_start_that_cannot_resume_the_checkpoint_is_refused_naming_the_keys(tmp_path, monkeypatch, capsys, changed, named):
    """A checkpoint saved by one run, a start with one key changed: refused by the launcher in one line naming
    the key and the choices, nothing started, the run's ``config.yaml`` byte for byte as it was."""
    from qwenkit import cli, launch

    out = tmp_path / "run"
    saved = qconfig.load(overrides=[*SAVED, f"train.output_dir={out}"])
    step = ckpt.step_dir(ckpt.checkpoint_root(out), 2)
    step.mkdir(parents=True)
    (step / ckpt.COMPLETE).write_text(json.dumps({"step": 2, "run": resume.run_record(saved, 1)}))
    record = qconfig.write_config(saved, out).read_bytes()
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    changed = [c.replace("FILE", str(data)) for c in changed]
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a refused start must not spawn"))
    capsys.readouterr()
    assert cli.main(["train", "--nproc", "1", *SAVED, *changed, f"train.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    refusal = [line for line in err.splitlines() if "cannot resume" in line]
    assert len(refusal) == 1 and named in refusal[0], err
    assert "another train.output_dir" in refusal[0] and "Traceback" not in err
    if "data" not in named:  # what the checkpoint holds: its weights are the way to start from it
        assert f"model.init_from={str(out)!r}" in refusal[0] and "train.resume=none" in refusal[0]
    assert (out / "config.yaml").read_bytes() == record
    # the same start is accepted where the keys agree (the record is the ranks' to rewrite: not here)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: 0)
    assert cli.main(["train", "--nproc", "1", *SAVED, f"train.output_dir={out}"]) == 0, capsys.readouterr().err
    assert (out / "config.yaml").read_bytes() == record


def test_a_checkpoint_from_before_the_state_record_is_not_compared(tmp_path):
    out = tmp_path / "run"
    saved = qconfig.load(overrides=[*SAVED, f"train.output_dir={out}"])
    old = {k: v for k, v in resume.run_record(saved, 1).items() if k not in (*resume.STATE_KEYS, "data.eval_fraction")}
    step = ckpt.step_dir(ckpt.checkpoint_root(out), 2)
    step.mkdir(parents=True)
    (step / ckpt.COMPLETE).write_text(json.dumps({"step": 2, "run": old}))
    now = qconfig.load(overrides=[*SAVED, f"train.output_dir={out}", "train.objective=dpo", "lora.r=8"])
    assert resume.decide(now, 1, check=lambda p: None).path == step  # the ranks check what they can
