"""The optimizer and its LR schedule: AdamW over parameter groups, linear warmup + cosine decay.

Groups: ``default`` (``train.lr``, ``train.weight_decay``) holds every trainable parameter that no
``train.param_groups`` pattern claims; each pattern (a module-path prefix, ``*`` = one segment,
e.g. ``model.visual.blocks.*`` at 2e-6 and ``model.visual.merger`` at 1e-5 as Qwen's own recipe
trains the vision tower and the merger) gets its own ``lr`` and optionally ``weight_decay``;
``train.no_decay`` splits every group once more, biases, norm weights and embeddings getting
``weight_decay`` 0. Every group follows the same warmup + cosine shape, from its own peak.

The schedule is the one of *this* run's config, also on a resume (:func:`build_scheduler`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qwenkit.distributed.fsdp import match_modules
from qwenkit.model.modules import module_path, prefix_match


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier of optimizer step ``step`` (1-based): linear warmup, then cosine to ``min_ratio``."""
    if step <= warmup:
        return step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def no_decay(name: str, param: nn.Parameter) -> bool:
    """The usual no-decay set: biases, norm weights (1-D) and embeddings."""
    return param.dim() < 2 or "embed" in name.split(".")[-2]


def group_problems(model: nn.Module, train_cfg) -> list[str]:
    """``train.param_groups`` patterns that name no module of ``model`` (the launcher runs this
    on the module tree built on meta, before any rank starts)."""
    problems = []
    for i, group in enumerate(train_cfg.param_groups):
        try:
            match_modules(model, [group.pattern], f"train.param_groups[{i}].pattern")  # shard_patterns' rule
        except ValueError as e:
            problems.append(str(e))
    return problems


def param_groups(model: nn.Module, train_cfg) -> list[dict]:
    """AdamW parameter groups: ``default`` (``train.lr``) first, then one per ``train.param_groups``
    entry, each split in two with ``train.no_decay``; empty groups are left out.

    Each group carries ``name`` and its configured ``base_lr`` / ``base_weight_decay``, which
    the LR schedule scales (the same warmup + cosine shape for every group).
    """
    specs = [("default", None, train_cfg.lr, train_cfg.weight_decay)]
    for g in train_cfg.param_groups:
        wd = train_cfg.weight_decay if g.weight_decay is None else g.weight_decay
        specs.append((g.pattern, g.pattern, g.lr, wd))
    buckets: dict[tuple[str, bool], list] = {}
    for pname, param in model.named_parameters():
        if not param.requires_grad:
            continue
        pname = module_path(pname)
        spec = next((s for s in specs[1:] if prefix_match(pname, s[1])), specs[0])
        nd = train_cfg.no_decay and no_decay(pname, param)
        buckets.setdefault((spec[0], nd), []).append(param)
    groups = []
    for name, _, lr, wd in specs:
        for nd in (False, True):
            params = buckets.get((name, nd))
            if params:
                label = f"{name} (no decay)" if nd else name
                groups.append({"params": params, "name": label, "lr": lr, "weight_decay": 0.0 if nd else wd,
                               "base_lr": lr, "base_weight_decay": 0.0 if nd else wd})  # fmt: skip
    return groups


def build_optimizer(model: nn.Module, train_cfg) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, in the groups of :func:`param_groups`."""
    groups = param_groups(model, train_cfg)
    if not groups:
        raise ValueError("no trainable parameters: model.freeze froze the whole model")
    # fused: one in-place kernel; the foreach default allocates a parameter-sized temporary
    fused = groups[0]["params"][0].device.type in ("cpu", "cuda") or None
    optimizer = torch.optim.AdamW(groups, lr=train_cfg.lr, betas=tuple(train_cfg.betas), fused=fused)
    # this run's group settings: a loaded optimizer state carries the old run's (see build_scheduler)
    optimizer.qwenkit_groups = [(g["name"], g["base_lr"], g["base_weight_decay"]) for g in optimizer.param_groups]
    return optimizer


def build_scheduler(optimizer, train_cfg, done: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of *this* run's config, positioned after ``done`` optimizer steps.

    A resume follows the config it runs with: step ``s`` uses ``train.lr * lr_factor(s)`` with
    this run's ``warmup_steps``, ``steps`` and ``min_lr_ratio``, whether or not the optimizer
    state was loaded and whatever LR the checkpoint's run used. Built after the load, it sets
    every param group's LR, so the LR an optimizer step applies is the one logged.
    """
    t = train_cfg
    configured = getattr(optimizer, "qwenkit_groups", None)  # set by build_optimizer
    for i, group in enumerate(optimizer.param_groups):
        # what LambdaLR scales, per group; a loaded optimizer carries the old run's
        if configured is None:
            group["initial_lr"] = t.lr
            continue
        name, lr, wd = configured[i]
        group.update(name=name, initial_lr=lr, base_lr=lr, weight_decay=wd, base_weight_decay=wd)
    # LambdaLR passes the number of steps taken so far; the step about to run is that + 1.
    # last_epoch=done-1: the constructor takes one step itself (-1: a fresh start).
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: lr_factor(n + 1, t.warmup_steps, t.steps, t.min_lr_ratio), last_epoch=done - 1
    )
