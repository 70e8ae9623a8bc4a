"""The objective registry (``train.objective``, :mod:`qwenkit.engine.objective`): one list, peers, and
the hook through which an objective supplies the step's micro-batches.

The hook is checked against a reference run: an objective that makes its own micro-batches (here:
the sampler's first batch, twice: ``grad_accum=2``) must train exactly as SFT on that one batch
(``grad_accum=1``): same loss, same gradient norm, same label-token count.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch.distributed as dist
from multiproc import check_ranks

from qwenkit import config as qconfig
from qwenkit.engine import objective
from qwenkit.engine.objectives import sft
from qwenkit.engine.run import metrics, train

PACKAGE = Path(__file__).resolve().parents[2] / "qwenkit"
BASE = ["data.tiny_samples=8", "train.steps=1", "train.resume=none", "checkpoint.save_final=false",
        "train.micro_batch_size=2", "train.warmup_steps=0"]  # fmt: skip


def test_every_registered_objective_is_an_entry_with_its_hooks():
    for name in qconfig.OBJECTIVES:
        cls = objective.entry(name)
        assert issubclass(cls, objective.Objective), name
        for hook in ("build", "loss", "evaluate_cli"):  # what the base class cannot do for it
            assert getattr(cls, hook) is not getattr(objective.Objective, hook), f"{name} has no {hook}"
    # the config accepts exactly the registry's names
    assert qconfig.TrainConfig.__annotations__["objective"] == "Literal[tuple(OBJECTIVES)]"


def test_an_unknown_objective_is_refused_by_name():
    with pytest.raises(ValueError, match=r"train\.objective='ppo' is not an objective; known: sft, dpo"):
        objective.entry("ppo")
    with pytest.raises(qconfig.ConfigError, match=r"train\.objective"):
        qconfig.load(overrides=["train.objective=ppo"])


def _objective_branches(source: str) -> list[str]:
    """Comparisons with an objective's name, or with ``objective`` / ``objective is None``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(s, ast.Constant) and s.value in qconfig.OBJECTIVES for s in sides)
        on_objective = any(ast.unparse(s).endswith("objective") for s in sides)
        if named or on_objective:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_engine_and_the_data_have_no_objective_branch():
    """The data side asks the entry what its rows are (``reads``), as the trainer asks it everything else."""
    files = sorted([*PACKAGE.glob("engine/**/*.py"), *PACKAGE.glob("data/*.py")])
    branches = {str(p.relative_to(PACKAGE)): _objective_branches(p.read_text()) for p in files}
    assert not {k: v for k, v in branches.items() if v}
    # the finder finds the branches this registry replaced
    assert _objective_branches('if t.objective == "dpo": pass\nif objective is not None: pass') == [
        "line 1: t.objective == 'dpo'", "line 2: objective is not None"
    ]  # fmt: skip


class Replay(sft.Sft):
    """Makes its own micro-batches: the sampler's first, ``count`` times (what GRPO's rollouts will do)."""

    calls: list[int] = []

    def micro_batches(self, model, batches, count):
        Replay.calls.append(count)
        assert model.training
        first = next(batches)
        return [dict(first) for _ in range(count)]


def _worker(rank, out):
    dist.init_process_group("gloo")
    qconfig.OBJECTIVES["replay"] = qconfig.ObjectiveEntry(f"{__name__}:Replay", "conversations")
    reference = train.run(qconfig.load(overrides=[*BASE, "train.grad_accum=1", f"train.output_dir={out / 'sft'}"]))
    cfg = qconfig.load(overrides=[*BASE, "train.grad_accum=2", f"train.output_dir={out / 'replay'}"])
    cfg.train.objective = "replay"  # registered above; the config's Literal lists the shipped ones
    replayed = train.run(cfg)
    (out / "calls.json").write_text(json.dumps({"calls": Replay.calls, "type": type(replayed.objective).__name__,
                                                "sft": type(reference.objective).__name__}))  # fmt: skip
    dist.destroy_process_group()


@pytest.mark.slow
def test_an_objective_supplies_the_steps_micro_batches(tmp_path, tiny_path):
    check_ranks(_worker, 1, tmp_path)
    got = json.loads((tmp_path / "calls.json").read_text())
    assert got == {"calls": [2], "type": "Replay", "sft": "Sft"}
    sft_run, replay = (metrics.read(tmp_path / name) for name in ("sft", "replay"))
    for name in ("loss", "grad_norm"):
        (a,), (b,) = metrics.series(sft_run, name).values(), metrics.series(replay, name).values()
        assert b == pytest.approx(a, rel=1e-5), name  # fp32: the same tokens, summed in two halves
    (items,) = metrics.series(replay, "valid_tokens").values()
    assert items == 2 * next(iter(metrics.series(sft_run, "valid_tokens").values()))  # counted from the hook's batches
