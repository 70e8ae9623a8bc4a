"""Notebook 02's run control: a run resumed from another's checkpoint (with a stand-in for qwenkit train), metrics reading."""

import json
import sys
import textwrap

import pytest

from qwenkit.engine.run import metrics
from qwenkit.notebooks import results, runs

# Writes the trainer's events (and a console line per step) and honours train.resume=<a step-N
# checkpoint> from its arguments: a resumed event, then steps from N + 1 (unless "ignore-resume").
FAKE_TRAINER = textwrap.dedent("""
    import pathlib, sys
    from qwenkit.engine.run import events
    log = events.EventLog(sys.argv[1], 0)
    log.write("started", world_size=1, steps=5)
    resume = [a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("train.resume=")]
    first = 1
    if resume and "ignore-resume" not in sys.argv:
        first = int(pathlib.Path(resume[0]).name.split("-")[1]) + 1
        log.write("resumed", step=first - 1, checkpoint=resume[0])
    for step in range(first, 6):
        log.write("step", step=step, steps=5, loss=5 - step * 0.1, tokens_per_s=100.0)
        print(f"step {step}/5  console line, not shown", flush=True)
""")


def _fake(monkeypatch, tmp_path, *extra):
    script = tmp_path / "fake_trainer.py"
    script.write_text(FAKE_TRAINER)
    monkeypatch.setattr(runs, "train_command", lambda config, output_dir, nproc, overrides: [
        sys.executable, "-u", str(script), str(output_dir), *overrides, *extra])  # fmt: skip


def test_train_shows_the_step_lines_and_logs_everything(tmp_path, monkeypatch):
    _fake(monkeypatch, tmp_path)
    shown = []
    run = runs.train("unused.yaml", tmp_path / "run", echo=shown.append, timeout_s=30)
    assert run.ok and run.returncode == 0 and run.resumed_from is None
    assert [s for s in shown if s.startswith("step")] == [f"step {s}/5  loss {5 - s * 0.1:.4f}  100 tok/s"
                                                          for s in range(1, 6)]  # fmt: skip
    assert not any("console line" in s for s in shown)
    assert "step 5/5  console line, not shown" in run.log.read_text()  # everything is in the log


def test_a_run_resumes_from_another_runs_checkpoint(tmp_path, monkeypatch):
    _fake(monkeypatch, tmp_path)
    shown = []
    checkpoint = runs.checkpoint_of(tmp_path / "first", 3)
    assert checkpoint == tmp_path / "first" / "checkpoints" / "step-00000003"
    run = runs.train("unused.yaml", tmp_path / "run", echo=shown.append, timeout_s=30, resume_from=checkpoint)
    assert run.resumed_from == 3 and f"train.resume={checkpoint}" in run.command
    assert [s for s in shown if s.startswith("step")] == ["step 4/5  loss 4.6000  100 tok/s", "step 5/5  loss 4.5000  100 tok/s"]
    assert f"resumed from {checkpoint} at step 3" in shown
    assert runs.train("unused.yaml", tmp_path / "fresh", echo=lambda s: None, timeout_s=30).resumed_from is None


def test_a_run_that_did_not_resume_where_asked_is_an_error(tmp_path, monkeypatch):
    _fake(monkeypatch, tmp_path, "ignore-resume")
    with pytest.raises(RuntimeError, match="did not resume from"):
        runs.train("unused.yaml", tmp_path / "run", echo=lambda s: None, timeout_s=30,
                   resume_from=runs.checkpoint_of(tmp_path / "first", 3))  # fmt: skip


def test_a_failing_run_raises_with_the_end_of_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "train_command", lambda *a: [sys.executable, "-c", "print('boom'); raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exit code 3(.|\n)*boom"):
        runs.train("unused.yaml", tmp_path / "run", echo=lambda s: None, timeout_s=30)


def test_fresh_dir_removes_only_runs(tmp_path):
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    assert runs.fresh_dir(run) == run and list(run.iterdir()) == []
    other = tmp_path / "other"
    other.mkdir()
    (other / "precious.txt").write_text("x")
    with pytest.raises(FileExistsError, match="holds no qwenkit run"):
        runs.fresh_dir(other)
    assert (other / "precious.txt").is_file()


def test_metrics_of_a_resumed_run_keep_the_last_value_of_each_step(tmp_path):
    rows0 = [results.record("loss", v, x_name="step", x=s, series="rank 0") | {"rank": 0}
             for s, v in [(1, 3.0), (2, 2.5), (3, 9.9), (2, 2.0), (3, 1.5)]]  # steps 2-3 re-run after a resume
    rows1 = [results.record("peak_memory", 100.0 + s, x_name="step", x=s, series="rank 1") | {"rank": 1} for s in (1, 2, 3)]
    results.write_jsonl(rows0, tmp_path / "metrics" / "rank-00000.jsonl")
    results.write_jsonl(rows1, tmp_path / "metrics" / "rank-00001.jsonl")
    with (tmp_path / "metrics" / "rank-00001.jsonl").open("a") as f:
        f.write('{"metric": "loss", "x": 4')  # a writer caught mid-line
    rows = metrics.read(tmp_path)
    assert len(rows) == len(rows0) + len(rows1) and metrics.read(tmp_path / "metrics" / "rank-00001.jsonl") == rows1
    assert metrics.series(rows, "loss") == {1: 3.0, 2: 2.0, 3: 1.5}
    assert metrics.series(rows, "peak_memory", rank=1) == {1: 101.0, 2: 102.0, 3: 103.0}
    summary = runs.summary_rows(rows)
    assert [r["rank"] for r in summary] == [0, 1]
    assert summary[0]["first loss"] == 3.0 and summary[0]["last loss"] == 1.5
    assert summary[1]["max peak memory (MiB)"] == 103.0
    times = [results.record("step_time", t, x_name="step", x=s, series="rank 0") | {"rank": 0}
             for s, t in [(1, 4.0), (2, 1.0), (3, 2.0), (4, 3.0)]]  # fmt: skip
    assert runs.summary_rows(times)[0]["median step time (s)"] == 2.5  # an even count: the mean of the middle two


def test_save_checks_the_resumed_curve_against_the_uninterrupted_one(tmp_path):
    def rows(values):
        return [{"metric": "loss", "series": "rank 0", "x": s, "value": v, "rank": 0} for s, v in values.items()]

    a = {1: 3.0, 2: 2.0, 3: 1.0, 4: 0.5}
    resumed = runs.TrainRun(tmp_path, [], 0, 1.0, tmp_path / "log", resumed_from=2)
    after = {3: 1.0, 4: 0.5}  # the resumed run's own metrics start after its checkpoint
    good = runs.save(tmp_path, rows(a), rows(after), 2, resumed)
    assert good["resume_matches"] and good["resumed_steps"] == 2 and good["loss_decreased"]
    assert good["resumed_from"] == 2 and json.loads((tmp_path / "metrics.json").read_text())["passed"]
    drifted = runs.save(tmp_path, rows(a), rows({**after, 4: 0.6}), 2, resumed)
    assert not drifted["resume_matches"] and drifted["resume_max_abs_diff"] == pytest.approx(0.1)
    assert not json.loads((tmp_path / "metrics.json").read_text())["passed"]
    short = runs.save(tmp_path, rows(a), rows({3: 1.0}), 2, resumed)  # a step the resumed run never reached
    assert not short["resume_matches"] and not json.loads((tmp_path / "metrics.json").read_text())["passed"]
    elsewhere = runs.save(tmp_path, rows(a), rows(after), 2, runs.TrainRun(tmp_path, [], 0, 1.0, tmp_path / "log"))
    assert elsewhere["resume_matches"] and not json.loads((tmp_path / "metrics.json").read_text())["passed"]


def test_save_compares_the_evaluations_after_the_resume_too(tmp_path):
    def rows(loss, eval_loss):
        return [{"metric": m, "series": "rank 0", "x": s, "value": v, "rank": 0}
                for m, values in (("loss", loss), ("eval_loss", eval_loss)) for s, v in values.items()]  # fmt: skip

    resumed = runs.TrainRun(tmp_path, [], 0, 1.0, tmp_path / "log", resumed_from=2)
    a = rows({1: 3.0, 2: 2.0, 3: 1.0, 4: 0.5}, {0: 3.5, 2: 2.5, 4: 1.5})
    assert runs.save(tmp_path, a, rows({3: 1.0, 4: 0.5}, {4: 1.5}), 2, resumed)["resume_matches"]
    off = runs.save(tmp_path, a, rows({3: 1.0, 4: 0.5}, {4: 1.7}), 2, resumed)
    assert not off["resume_matches"] and off["resume_max_abs_diff"] == pytest.approx(0.2)


def test_save_records_the_held_out_loss_and_accuracy_first_and_last(tmp_path):
    rows = [{"metric": m, "series": "rank 0", "x": s, "value": v, "rank": 0}
            for m, s, v in [("loss", 1, 3.0), ("loss", 2, 2.0), ("eval_loss", 0, 3.5), ("eval_loss", 1, 3.1),
                            ("eval_loss", 2, 2.4), ("eval_accuracy", 0, 0.125), ("eval_accuracy", 2, 0.5)]]  # fmt: skip
    resumed = runs.TrainRun(tmp_path, [], 0, 1.0, tmp_path / "log", resumed_from=1)
    v = runs.save(tmp_path, rows, rows, 1, resumed)
    assert (v["first_eval_loss"], v["last_eval_loss"]) == (3.5, 2.4)
    assert (v["first_eval_accuracy"], v["last_eval_accuracy"], v["eval_accuracy_steps"]) == (0.125, 0.5, [0, 2])
    summary = json.loads((tmp_path / "metrics.json").read_text())["summary"]
    assert "held-out accuracy 0.12 -> 0.50 (step 0 -> 2)" in summary
    run = tmp_path / "run"
    results.write_jsonl(rows, run / "metrics" / "rank-00000.jsonl")
    loss_fig, acc_fig = runs.eval_figures(run)
    assert [list(t.x) for t in loss_fig.data] == [[1, 2], [0, 1, 2]]  # training loss, then the eval loss
    assert list(acc_fig.data[0].y) == [0.125, 0.5]


def test_lora_comparison_reads_manifest_checkpoint_memory_time_and_accuracy(tmp_path):
    runs_dirs = {}
    for name, trainable, ckpt_bytes, acc in (("LoRA r=8", 16, 100, 0.25), ("full fine-tune", 200, 4000, 0.5)):
        run = tmp_path / name.replace(" ", "_")
        (run / "checkpoints" / "step-00000004").mkdir(parents=True)
        (run / "checkpoints" / "step-00000004" / "COMPLETE.json").write_text("{}")
        (run / "checkpoints" / "step-00000004" / "__0_0.distcp").write_bytes(b"x" * ckpt_bytes)
        (run / "checkpoints" / "step-00000002").mkdir()  # incomplete: never the one measured
        parts = {"model.visual": {"total": 16, "trainable": 0, "adapters": 0},
                 "model.language_model": {"total": 200, "trainable": trainable, "adapters": 16}}  # the trainer's file
        (run / "parameters.json").write_text(json.dumps(parts))
        rows = [{"metric": m, "series": "rank 0", "x": s, "value": v, "rank": 0}
                for m, s, v in [("eval_accuracy", 0, 0.0), ("eval_accuracy", 4, acc), ("step_time", 1, 1.0),
                                ("step_time", 2, 3.0), ("peak_memory", 1, 50.0), ("peak_memory", 2, 70.0)]]  # fmt: skip
        results.write_jsonl(rows, run / "metrics" / "rank-00000.jsonl")
        runs_dirs[name] = run
    got = runs.save_comparison(tmp_path, runs_dirs)
    assert [r["run"] for r in got] == list(runs_dirs)
    assert [r["trainable parameters"] for r in got] == [16, 200] and got[0]["total parameters"] == 216
    assert [r["checkpoint (MiB)"] for r in got] == [(100 + 2) / 2**20, (4000 + 2) / 2**20]
    assert [(r["first accuracy"], r["last accuracy"]) for r in got] == [(0.0, 0.25), (0.0, 0.5)]
    assert got[0]["median step time (s)"] == 2.0 and got[0]["max peak memory (MiB)"] == 70.0
    saved = results.read_csv(tmp_path / runs.COMPARISON)
    assert {(r["series"], r["metric"]): r["value"] for r in saved}[("full fine-tune", "last accuracy")] == 0.5
    runs.comparison_table(got)
