"""On-policy distillation (``train.objective: distill``) in the trainer: the objective's log-probs of both models
and its loss against full logits, packed = padded.

The teacher scores the student's sampled tokens where GRPO's reference does, through its chunked head (no
``[B, S, V]`` logits) under the distribution the rollout sampled: both models' logits over ``grpo.temperature``,
the media tokens banned. The reference here is each model's HF forward's full logits, tempered and banned
by hand, and the loss formula written out on them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_model

from engine.objectives.test_packed_rl import _made_up
from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.distributed import fsdp
from qwenkit.engine.generation.generate import model_inputs
from qwenkit.engine.objectives.distill import DistillObjective
from qwenkit.engine.rollouts.completion import completion_mask

# fp32; the chunked head sums the softmax over V in another order than log_softmax of the full logits
FP32 = dict(rtol=1e-5, atol=1e-6)


def _objective(tiny_path, processor, teacher, temperature, packing=False):
    cfg = qconfig.load(overrides=["train.objective=distill", f"model.path={tiny_path}", f"distill.teacher={tiny_path}",
                                  "data.tiny_samples=4", "train.micro_batch_size=2", "grpo.num_generations=3",
                                  f"grpo.temperature={temperature}", f"data.packing={str(packing).lower()}"])  # fmt: skip
    objective = DistillObjective(cfg, fsdp.Runtime(0, 1, 0, torch.device("cpu"), "gloo", False),
                                 data.build(cfg, processor), "pixels", reference=teacher)  # fmt: skip
    objective.rollouts = _made_up(processor, cfg.grpo.num_generations)
    return objective


def _step(objective, student):
    """One step's micro-batch: the rollout (the teacher's log-probs), the loss and its gradient."""
    (batch,) = objective._rollout(student, 1)
    counts = torch.stack([batch.pop("num_items"), batch.pop("num_samples")])
    teacher = batch["ref_logps"].clone()
    objective.begin([batch], counts)
    student.zero_grad()
    loss = objective.loss(student, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    return batch, teacher, loss.detach(), grads, objective.metrics()


def _full_logps(model, batch, temperature, banned):
    """The labels' log-probs ``[B, S]`` under HF's full logits over ``temperature``, ``banned`` never drawn."""
    model.configure_loss(chunk=False)
    try:
        logits = model(**{k: v for k, v in batch.items() if k in model_inputs(model) and k != "labels"}).logits
    finally:
        model.configure_loss(chunk=True)
    logits = (logits.float() / temperature).index_fill(-1, torch.tensor(banned), -torch.inf)
    labels = batch["labels"][:, 1:]
    logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    return torch.nn.functional.pad(logps * (labels != -100), (0, 1))  # position t scores labels[t + 1]


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.8])
def test_both_models_log_probs_and_the_loss_equal_full_logits_at_the_sampling_temperature(temperature, tiny_path, processor):
    """The teacher's ``ref_logps`` and the student's log-probs are those of the full logits over the temperature
    (media tokens banned); the loss is the token mean of ``log p_s - log p_t`` over the completion tokens, and
    its gradient that of ``sum (log p_s - log p_t).detach() * log p_s / N`` through HF's full forward."""
    student, teacher = build_model(chunk=True, seed=1), build_model(chunk=True, seed=2)
    objective = _objective(tiny_path, processor, teacher, temperature)
    batch, got_teacher, loss, grads, metrics = _step(objective, student)
    mask = completion_mask(batch)
    with torch.no_grad():
        want_teacher = _full_logps(teacher, batch, temperature, objective.banned)
    torch.testing.assert_close(got_teacher[mask], want_teacher[mask], **FP32)
    student.zero_grad()
    want_student = _full_logps(student, batch, temperature, objective.banned)
    k = (want_student - want_teacher).detach() * mask
    torch.testing.assert_close(loss, k.sum() / mask.sum(), **FP32)
    assert metrics["reverse_kl"] == pytest.approx(float(k.sum() / mask.sum()), rel=1e-5, abs=1e-6)
    assert float(k.abs().sum()) > 0.01 * float(mask.sum())  # the two random models differ: a real signal
    ((k * want_student).sum() / mask.sum()).backward()
    for name, p in student.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)  # a backward through other kernels


def test_packed_micro_batch_trains_as_the_padded_one(tiny_path, processor):
    """``data.packing: true``: the micro-batch's rows packed into one give the padded batch's teacher log-probs,
    loss and gradients (GRPO's packed path, tests/engine/objectives/test_packed_rl.py)."""
    student, teacher = build_model(chunk=True, seed=1), build_model(chunk=True, seed=2)
    padded = _step(_objective(tiny_path, processor, teacher, 0.7), student)
    packed = _step(_objective(tiny_path, processor, teacher, 0.7, packing=True), student)
    assert "packed_seq_lens" in packed[0] and "packed_seq_lens" not in padded[0]
    torch.testing.assert_close(packed[1][completion_mask(packed[0])], padded[1][completion_mask(padded[0])], **FP32)
    torch.testing.assert_close(packed[2], padded[2], **FP32)
    for name, grad in padded[3].items():
        torch.testing.assert_close(packed[3][name], grad, **FP32)
