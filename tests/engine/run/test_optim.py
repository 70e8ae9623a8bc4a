"""qwenkit.engine.run.optim: the LR factor (warmup, cosine to the floor), the parameter groups a config makes
(patterns, no-decay split, frozen parameters left out) against a hand-sorted reference, and a scheduler
built after ``done`` steps giving the LRs an uninterrupted one gives from there."""

from __future__ import annotations

import math

import pytest
from torch import nn

from qwenkit import config as qconfig
from qwenkit.engine.run import optim


def test_lr_warmup_then_cosine_to_the_floor():
    f = [optim.lr_factor(s, warmup=4, total=20, min_ratio=0.1) for s in range(1, 21)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a > b for a, b in zip(f[3:], f[4:]))  # strictly decreasing after warmup
    assert math.isclose(f[-1], 0.1)
    assert math.isclose(optim.lr_factor(12, warmup=4, total=20, min_ratio=0.1), 0.1 + 0.9 * 0.5)  # half-way
    assert optim.lr_factor(1, warmup=0, total=10, min_ratio=0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 10)))


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.norm = nn.LayerNorm(4)
        self.merger = nn.Linear(4, 4)


class _Model(nn.Module):
    """Module paths like the subclass's: ``model.visual.blocks.N``, ``model.visual.merger``, ``lm_head``."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.visual = _Tower()
        self.lm_head = nn.Linear(4, 10, bias=False)


def _train(*overrides):
    return qconfig.load(overrides=["train.lr=1.0e-3", "train.weight_decay=0.1", *overrides]).train


def test_param_groups_sort_every_trainable_parameter_once():
    model = _Model()
    model.model.visual.blocks[1].weight.requires_grad_(False)  # frozen: in no group
    cfg = _train("train.no_decay=true", "train.param_groups=[{pattern: model.visual.blocks.*, lr: 2.0e-6}, "
                 "{pattern: model.visual.merger, lr: 1.0e-5, weight_decay: 0.0}]")  # fmt: skip
    groups = optim.param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    got = {g["name"]: ([names[id(p)] for p in g["params"]], g["lr"], g["weight_decay"]) for g in groups}
    # the reference, sorted by hand: a pattern claims its modules; no_decay takes biases, norms, embeddings
    assert got == {
        "default": (["lm_head.weight"], 1e-3, 0.1),
        "default (no decay)": (["model.visual.embed_tokens.weight", "model.visual.norm.weight",
                                "model.visual.norm.bias"], 1e-3, 0.0),
        "model.visual.blocks.*": (["model.visual.blocks.0.weight"], 2e-6, 0.1),
        "model.visual.blocks.* (no decay)": (["model.visual.blocks.0.bias", "model.visual.blocks.1.bias"], 2e-6, 0.0),
        "model.visual.merger": (["model.visual.merger.weight"], 1e-5, 0.0),
        "model.visual.merger (no decay)": (["model.visual.merger.bias"], 1e-5, 0.0),
    }  # fmt: skip
    assert [g["name"] for g in groups][0] == "default"  # train.lr's group first: the one a log's "lr" is
    plain = optim.param_groups(model, _train())  # no patterns, no split: one group of every trainable parameter
    assert [(g["name"], len(g["params"])) for g in plain] == [("default", len(names) - 1)]


def test_a_pattern_that_names_no_module_is_a_problem():
    problems = optim.group_problems(_Model(), _train("train.param_groups=[{pattern: model.vision.blocks, lr: 1.0e-5}]"))
    assert len(problems) == 1 and "train.param_groups[0].pattern" in problems[0] and "model.vision.blocks" in problems[0]
    assert optim.group_problems(_Model(), _train("train.param_groups=[{pattern: model.visual.merger, lr: 1.0e-5}]")) == []


@pytest.mark.parametrize("done", [0, 3, 7])
def test_a_scheduler_built_after_done_steps_continues_the_uninterrupted_one(done):
    cfg = _train("train.steps=10", "train.warmup_steps=3", "train.param_groups=[{pattern: model.visual.merger, lr: 1.0e-5}]")

    def lrs(optimizer, scheduler, n):
        out = []
        for _ in range(n):
            out.append([g["lr"] for g in optimizer.param_groups])  # what the next step applies
            optimizer.step()
            scheduler.step()
        return out

    whole = optim.build_optimizer(_Model(), cfg)
    reference = lrs(whole, optim.build_scheduler(whole, cfg), 10)
    resumed = optim.build_optimizer(_Model(), cfg)
    # the same float operations (base LR x factor of the step): equal, not close
    assert lrs(resumed, optim.build_scheduler(resumed, cfg, done=done), 10 - done) == reference[done:]
    # each group from its own peak, on the same shape
    assert [r[1] / r[0] for r in reference] == pytest.approx([1e-2] * 10)
    assert reference[0][0] == pytest.approx(1e-3 * optim.lr_factor(1, 3, 10, cfg.min_lr_ratio))


def test_everything_frozen_is_refused_in_one_line():
    model = _Model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters: model.freeze froze the whole model"):
        optim.build_optimizer(model, _train())
