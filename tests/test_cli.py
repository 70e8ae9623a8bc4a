"""qwenkit.cli: the subcommands' parsing (overrides anywhere, ``--traceback`` on every one) and what
``qwenkit train`` refuses before any process starts."""

from __future__ import annotations

import os

import pytest

from qwenkit import cli, errors, launch
from qwenkit import config as qconfig


def test_traceback_switch_on_every_subcommand(tmp_path, capsys):
    """An input error is one line and exit 2; with --traceback the traceback comes above it."""
    parser = cli.build_parser()
    leaves = [["train"], ["data", "check", "x"], ["data", "prepare", "x"], ["export", "a", "b"], ["eval", "a"],
              ["sweep", "run", "f"], ["sweep", "status", "d"], ["notebooks", "run"]]  # fmt: skip
    for argv in leaves:
        assert parser.parse_args([*argv, "--traceback"]).traceback, argv
    for argv in (["train", "train.steps=0"], ["data", "check", "tiny", "data.max_length=0"],
                 ["export", str(tmp_path), str(tmp_path / "hf")]):  # fmt: skip
        os.environ.pop(errors.TRACEBACK_ENV, None)
        assert cli.main(argv) == 2
        plain = capsys.readouterr().err
        assert len(plain.strip().splitlines()) == 1 and "Traceback" not in plain, plain
        try:
            assert cli.main([*argv, "--traceback"]) == 2
        finally:
            os.environ.pop(errors.TRACEBACK_ENV, None)
        shown = capsys.readouterr().err
        assert shown.startswith("Traceback (most recent call last)") and shown.strip().splitlines()[-1] == plain.strip()


def test_overrides_may_stand_before_or_after_options(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "_train", lambda args: seen.update(vars(args)) or 0)  # main builds its parser after
    assert cli.main(["train", "train.steps=3", "--nproc", "2", "loss.chunk_size=64"]) == 0
    assert seen["nproc"] == 2 and seen["overrides"] == ["train.steps=3", "loss.chunk_size=64"]
    assert cli.main(["export", "a", "b", "train.steps=3"]) == 2  # export takes no overrides


def test_timeout_key_is_validated_before_spawning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("must not start"))
    assert cli.main(["train", "parallel.timeout_s=0", f"train.output_dir={tmp_path / 'run'}"]) == 2
    assert "parallel.timeout_s must be >= 1" in capsys.readouterr().err
    assert qconfig.load().parallel.timeout_s == 600


@pytest.mark.parametrize("samples", ["0", "-1"])
def test_eval_of_no_rows_is_refused_in_one_line_before_anything_loads(samples, tmp_path, monkeypatch, capsys):
    """``--samples 0`` wrote an empty generations file and exited 0: a command that did nothing."""
    from qwenkit.engine.generation import eval_command

    monkeypatch.setattr(eval_command, "load_for_eval", lambda *a, **k: pytest.fail("the model must not load"))
    out = tmp_path / "g.jsonl"
    assert cli.main(["eval", str(tmp_path), "--samples", samples, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"qwenkit eval: --samples must be >= 1 (rows to evaluate; leave it out for the "
                                       f"run's train.eval_samples), got {samples}\n")  # fmt: skip
    assert not out.exists()


def test_an_eval_rank_leaves_a_shared_input_error_to_rank_0(tmp_path, monkeypatch, capsys):
    """Under ``qwenkit eval --nproc N`` every rank reads the same arguments, config and data: rank 0
    says their error, once (it was printed by every rank). An error in a rank's own share of the
    rows (a user's metric on them) is said by the rank that meets it."""
    from qwenkit.engine.generation import answers, eval_command

    monkeypatch.setenv(errors.COMMAND_ENV, "eval")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["eval", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["eval", str(tmp_path / "nowhere")]) == 2
    assert "qwenkit eval: " in capsys.readouterr().err

    def metric_fails(request):
        raise answers.UserFunctionError("eval metric 'f' returned nan on eval row 3; a score must be a finite number")

    monkeypatch.setattr(eval_command, "eval_main", metric_fails)
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["eval", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "qwenkit eval: eval metric 'f' returned nan on eval row 3; a score must be a finite number\n"


def test_a_known_engine_failure_in_eval_is_one_line_said_by_the_rank_that_met_it(tmp_path, monkeypatch, capsys):
    """``qwenkit eval --engine vllm`` whose vLLM has no room for its KV cache: the kit's one line, exit 2,
    as an input error (it was a traceback); under ``--nproc`` the rank whose engine failed says it."""
    from qwenkit.engine.generation import eval_command, vllm_engine

    said = "vLLM has no memory left for its KV cache (vLLM: ...); raise vllm.gpu_memory_utilization (CUDA)"

    def engine_fails(request):
        raise vllm_engine.EngineFailure(said)

    monkeypatch.setattr(eval_command, "eval_main", engine_fails)
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)
    assert cli.main(["eval", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"qwenkit eval: {said}\n"
    monkeypatch.setenv(errors.COMMAND_ENV, "eval")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["eval", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"qwenkit eval: {said}\n"
