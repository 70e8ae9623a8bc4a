"""Packed GRPO and DPO training forwards (``data.packing: true``): a micro-batch's rows packed into one row
train exactly as the right-padded micro-batch of the same rows.

References: the padded micro-batch of the same completions (GRPO: the objective's loss with its old and
reference log-probs, and every gradient) and of the same pairs (DPO: per-sequence log-probs, counts and
the gradients of a DPO-like weighted sum), in fp32, on every family that packs; through ``qwenkit train``
(launcher, pre-spawn checks) the packed run's logged loss and gradient norm equal the padded run's and its
``padding_fraction`` is 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import families_allowing
from multiproc import scaled

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.distributed import fsdp
from qwenkit.engine.objectives import dpo as preference
from qwenkit.engine.objectives import grpo
from qwenkit.engine.rollouts.completion import Completion
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as families

ROOT = Path(__file__).resolve().parents[3]
# fp32: the packed row's attention sums over the same keys as the padded row's (its mask blocks the rest),
# in another blocking of the matmuls: a few ulps
FP32 = dict(rtol=1e-5, atol=1e-6)
# the DPO test's loss is a sum over whole sequences (tens of tokens each), not a mean: its gradients are as
# many times larger, and so is their rounding
FP32_SUMS = dict(rtol=1e-5, atol=1e-5)
PACKING = families_allowing("packing")  # the Omni thinkers refuse packing pre-spawn (their entries' not_exact)


def vowels(prediction: str, reference: str, **row) -> float:
    """A reward the made-up completions differ by: their share of vowels."""
    return sum(c in "aeiou" for c in prediction) / max(1, len(prediction))


def _made_up(processor, count: int):
    """Rollouts of fixed completions of different lengths (words of the tokenizer, no media token): the
    same ones for the padded and the packed objective."""
    words = ["the", "cat", "is", "on", "a", "mat", "blue", "sky", "eats", "fish", "oh", "io"]

    def rollouts(model, dataset, indices, draw):
        done = []
        for k, i in enumerate(indices):
            prompt, conv = dataset.prompt(i)
            for g in range(count):
                text = " ".join(words[(k + g + j) % len(words)] for j in range(1 + (3 * k + 2 * g) % 7))
                tokens = processor.tokenizer.encode(text, add_special_tokens=False)
                done.append(Completion(i, prompt, tokens, text, g == count - 1, conv.reference, dataset.columns(i)))
        return done

    return rollouts


def _grpo_loss_and_grads(family, family_path, processor, packing: bool):
    cfg = qconfig.load(overrides=["train.objective=grpo", f"model.name={family}", f"model.path={family_path}",
                                  "data.tiny_samples=4", "train.micro_batch_size=2", "grpo.num_generations=3",
                                  "grpo.num_iterations=2", "grpo.beta=0.04", "grpo.temperature=0.7",
                                  "grpo.mask_truncated_completions=true",
                                  "grpo.rewards=[engine.objectives.test_packed_rl:vowels]",
                                  f"data.packing={str(packing).lower()}"])  # fmt: skip
    torch.manual_seed(0)
    model = registry.build(cfg.model, cfg.loss)
    objective = grpo.GrpoObjective(cfg, fsdp.Runtime(0, 1, 0, torch.device("cpu"), "gloo", False),
                                   data.build(cfg, processor), families.get(family).box_units, reference=model)  # fmt: skip
    objective.rollouts = _made_up(processor, cfg.grpo.num_generations)
    (batch,) = objective._rollout(model, 1)
    assert ("packed_seq_lens" in batch) == packing and ("attention_mask" in batch) != packing
    counts = torch.stack([batch.pop("num_items"), batch.pop("num_samples")])
    objective.begin([batch], counts)
    loss = objective.loss(model, batch)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), counts, grads, objective.metrics()


@PACKING
def test_packed_grpo_equals_padded_grpo_loss_and_every_gradient(family, family_path, family_processor):
    """Both objectives' old, reference and current log-probs, the truncated completion's mask, the KL and
    the loss: the packed row's log-probs come back in the padded layout (``token_logps``'s unpacking)."""
    padded = _grpo_loss_and_grads(family, family_path, family_processor, packing=False)
    packed = _grpo_loss_and_grads(family, family_path, family_processor, packing=True)
    torch.testing.assert_close(packed[0], padded[0], **FP32)
    assert padded[0] != 0 and packed[1].tolist() == padded[1].tolist()
    assert packed[2].keys() == padded[2].keys() and padded[2]
    for name, g in padded[2].items():
        torch.testing.assert_close(packed[2][name], g, **FP32, msg=name)
    for name, value in padded[3].items():  # kl, entropy, clipping, rewards, lengths (the seconds aside)
        assert name == "rollout_time" or packed[3][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@PACKING
def test_packed_dpo_pairs_give_the_padded_sequence_logps_counts_and_gradients(family, family_path, family_processor):
    """The pairs of three layouts (text-only prompts among them), chosen rows first, packed into one row."""
    def batch(packing):
        cfg = qconfig.load(overrides=["train.objective=dpo", f"model.name={family}", f"model.path={family_path}",
                                      "data.tiny_samples=16", f"data.packing={str(packing).lower()}"])  # fmt: skip
        bundle = data.build(cfg, family_processor)
        out = bundle.collator([bundle.dataset[p] for p in (0, 1, 2)])
        return cfg, {k: out.pop(k) for k in ("num_pairs", "num_chosen_items", "num_items")}, out

    cfg, padded_counts, padded = batch(False)
    _, packed_counts, packed = batch(True)
    assert "packed_seq_lens" in packed and packed["input_ids"].shape[0] == 1
    assert {k: int(v) for k, v in packed_counts.items()} == {k: int(v) for k, v in padded_counts.items()}
    torch.manual_seed(0)
    model = registry.build(cfg.model, cfg.loss)
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for b in (padded, packed):
        b = {k: v for k, v in b.items() if k not in ("pair_index", "num_samples")}
        sums, counts = preference.policy_logps(model, b)
        g = torch.linspace(-1, 1, sums.shape[0])  # a per-sequence upstream gradient, as DPO's
        results.append((sums, counts, torch.autograd.grad((sums * g).sum(), params, allow_unused=True)))
    (sums, counts, grads), (p_sums, p_counts, p_grads) = results
    torch.testing.assert_close(p_sums, sums.detach(), **FP32)
    assert p_counts.tolist() == counts.tolist() and min(counts.tolist()) > 0
    for a, b in zip(p_grads, grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **FP32_SUMS)


def _qwenkit(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))  # the tests' reward
    return subprocess.run([sys.executable, "-m", "qwenkit.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(600), env=env)  # fmt: skip


def _logged(run: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
    out: dict[int, dict[str, float]] = {}
    for r in rows:
        out.setdefault(r["x"], {})[r["metric"]] = r["value"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["grpo", "dpo"])
def test_packed_runs_through_qwenkit_train_equal_the_padded_runs(objective, tmp_path, tiny_path):
    """Two steps of each objective through ``qwenkit train`` (the launcher, its pre-spawn checks, one rank),
    padded then packed: the same rollouts (GRPO) or pairs (DPO), so the same losses, gradient norms and
    (GRPO) rewards; the packed run computes no padding."""
    keys = ["train.steps=2", "train.micro_batch_size=2", "train.resume=none", "train.max_grad_norm=0",
            "train.lr=0.01", "train.warmup_steps=0", "checkpoint.save_final=false", "parallel.nproc=1",
            f"train.objective={objective}", "data.tiny_samples=8"]  # fmt: skip
    if objective == "grpo":
        keys += ["grpo.num_generations=3", "grpo.max_new_tokens=6", "grpo.beta=0.04",
                 "grpo.rewards=[engine.objectives.test_packed_rl:vowels]"]  # fmt: skip
    runs = {}
    for packing in ("false", "true"):
        run = tmp_path / f"packing-{packing}"
        proc = _qwenkit("train", *keys, f"data.packing={packing}", f"train.output_dir={run}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[packing] = _logged(run)
    padded, packed = runs["false"], runs["true"]
    assert sorted(padded) == sorted(packed) == [1, 2]
    for step in (1, 2):
        for key in ("loss", "grad_norm", *(("reward", "kl") if objective == "grpo" else ("rewards/margins",))):
            assert packed[step][key] == pytest.approx(padded[step][key], rel=1e-4, abs=1e-6), (step, key)
        assert packed[step]["padding_fraction"] == 0
    if objective == "grpo":  # completions of other lengths were padded (the tiny pairs are of equal lengths mostly)
        assert max(padded[step]["padding_fraction"] for step in (1, 2)) > 0
