"""LoRA (peft) under FSDP2 and per-module parameter groups, on the tiny model.

References: one process vs 2 gloo ranks; HF's head vs the chunked one; an uninterrupted run vs
a resumed one; peft's own ``PeftModel.from_pretrained`` on HF's class vs qwenkit's model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import EVERY_FAMILY, assert_adamw_weights_close, make_batch, record_applied, tiny_checkpoint
from multiproc import check_ranks, free_port
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from qwenkit import config as qconfig
from qwenkit import launch
from qwenkit.distributed import fsdp
from qwenkit.engine.checkpoints import export as hf_export
from qwenkit.engine.run import metrics, optim, train
from qwenkit.model import lora
from qwenkit.model.families import build as registry
from qwenkit.model.families import registry as families
from qwenkit.model.losses import cross_entropy as qloss

ROOT = Path(__file__).resolve().parents[2]
FP32 = dict(rtol=1e-5, atol=1e-5)  # fp32 both sides; sums over ranks run in another order
LORA = ["lora.r=4", "lora.alpha=8", "lora.modules_to_save=[model.visual.merger]"]
LR, STEPS = 1e-2, 3
BASE = [
    f"train.steps={STEPS}", "train.micro_batch_size=2", "train.warmup_steps=1", "train.resume=none",
    "checkpoint.save_final=false", "data.tiny_samples=16", "loss.chunk=true", "loss.chunk_size=16",
    f"train.lr={LR}",
]  # fmt: skip
RECOMPUTE = "parallel.recompute=[model.language_model.layers.*, model.visual.blocks.*]"
RUNS_2 = {
    "lora": LORA,
    "meta": LORA + [RECOMPUTE, "model.init_device=meta"],
    "offload": LORA + [RECOMPUTE, "parallel.activation_offload=true"],
    # the vision tower's adapters, rsLoRA's scale and DoRA's magnitudes in one run
    "vision_dora": LORA + ["lora.vision=true", "lora.use_rslora=true", "lora.use_dora=true"],
    # packed rows under a token budget: batches of another make-up, so no one-process twin here
    "packed_budget": LORA + ["data.packing=true", "data.max_tokens_per_batch=300", "data.max_length=300"],
}
RUNS_1 = {"lora": LORA, "vision_dora": RUNS_2["vision_dora"]}
REFERENCE = {"lora": "lora", "meta": "lora", "offload": "lora", "vision_dora": "vision_dora", "bf16": "lora",
             "hsdp": "lora"}  # fmt: skip
RUNS_2["bf16"] = LORA + ["parallel.param_dtype=bfloat16", "parallel.reduce_dtype=float32"]
RUNS_2["hsdp"] = LORA + ["parallel.hsdp_replicas=2"]  # mesh (2 replicas, 1 shard)
if fsdp.hsdp_problem(qconfig.load(overrides=["parallel.hsdp_replicas=2", "parallel.backend=gloo"]).parallel):
    del RUNS_2["hsdp"], REFERENCE["hsdp"]  # torch < 2.8: the launcher refuses HSDP on gloo
# bf16 compute against the fp32 reference: 8 bits of mantissa (relative 4e-3 per op), as tests/distributed/test_fsdp.py
TOLERANCE = {"bf16": dict(rtol=2e-2, atol=2e-2)}
# bf16 weights: AdamW moves an element by up to ~lr per step whatever its gradient's size, so
# where bf16 noise flips the sign of a tiny gradient two runs part by up to 2 x lr per step
WEIGHT_TOLERANCE = {"bf16": dict(rtol=2e-2, atol=2 * LR * STEPS)}


def _grads_of_one_step(trainer):
    """Names of the parameters that get a gradient, and whether the chunked head asked for grad W."""
    asked = []
    real = qloss.chunk_pass

    def spy(*args):
        asked.append(args[8])  # need_w
        return real(*args)

    qloss.chunk_pass = spy
    try:
        batch = next(trainer.bundle.batches())
        train._counts(batch)  # pops num_items / num_samples
        trainer.model(**batch, use_cache=False).loss.backward()
    finally:
        qloss.chunk_pass = real
    names = [n.replace("._checkpoint_wrapped_module", "") for n, p in trainer.model.named_parameters() if p.grad is not None]
    trainer.optimizer.zero_grad(set_to_none=True)
    return names, asked


def _train_runs(rank, out, runs, grad_accum):
    dist.init_process_group("gloo")
    for name, overrides in runs.items():
        cfg = qconfig.load(overrides=BASE + overrides + [f"train.grad_accum={grad_accum}", f"train.output_dir={out}/{name}"])
        trainer = train.run(cfg)
        trained = {n.replace("._checkpoint_wrapped_module", "") for n, p in trainer.model.named_parameters() if p.requires_grad}
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        copied = _copy_for_generation(trainer.model, rank) if name == "lora" else {}
        got_grad, asked_w = _grads_of_one_step(trainer)
        if rank == 0:
            torch.save({
                "losses": [h["loss"] for h in trainer.history], "grad_norms": [h["grad_norm"] for h in trainer.history],
                "trained": sorted(trained), "state": state, "got_grad": got_grad, "asked_w": asked_w, **copied,
            }, out / f"{name}.pt")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_path):
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    check_ranks(_train_runs, 1, one, RUNS_1, 2, timeout=600)
    check_ranks(_train_runs, 2, two, RUNS_2, 1, timeout=600)
    return {n: torch.load(one / f"{n}.pt") for n in RUNS_1}, {n: torch.load(two / f"{n}.pt") for n in RUNS_2}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REFERENCE))
def test_two_ranks_equal_one_process(runs, name):
    ones, twos = runs
    ref, got = ones[REFERENCE[name]], twos[name]
    tol = TOLERANCE.get(name, FP32)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **tol)
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), **tol)
    assert got["state"].keys() == ref["state"].keys()
    if name in WEIGHT_TOLERANCE:
        for key, value in ref["state"].items():
            torch.testing.assert_close(got["state"][key], value, **WEIGHT_TOLERANCE[name], msg=lambda m, k=key: f"{k}: {m}")
    else:
        assert_adamw_weights_close(got["state"], ref["state"], tol, lr=LR, steps=STEPS, trained=got["trained"])
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS_2))
def test_only_adapters_and_saved_modules_train_and_get_gradients(runs, name):
    got = runs[1][name]
    assert got["trained"] and all(lora.is_adapter_key(n) or n.startswith("model.visual.merger.") for n in got["trained"])
    assert any(n.startswith("model.visual.merger.") for n in got["trained"])
    assert sorted(got["got_grad"]) == got["trained"]
    assert any("model.visual.blocks" in n for n in got["trained"]) == (name == "vision_dora")
    assert any(".lora_magnitude_vector." in n for n in got["trained"]) == (name == "vision_dora")
    # the frozen lm_head under FSDP2: the chunked head never allocates its fp32 weight gradient
    assert got["asked_w"] and not any(got["asked_w"])
    # B = 0 at the start, adapters moved by training; the base weights did not
    b = [k for k in got["trained"] if ".lora_B." in k]
    assert b and all(got["state"][k].abs().sum() > 0 for k in b)


@pytest.mark.slow
def test_meta_init_gives_the_adapters_of_cpu_init(runs):
    twos = runs[1]
    assert twos["meta"]["losses"] == twos["lora"]["losses"]  # exact: same base, same adapter draws


def _lora_model(overrides=(), seed=3):
    cfg = qconfig.load(overrides=[*LORA, *overrides])
    model = registry.build(cfg.model, cfg.loss)
    lora.apply(model, cfg.lora, seed)
    with torch.no_grad():  # B = 0 would make every adapter gradient of A zero: give B values
        g = torch.Generator().manual_seed(seed)
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@EVERY_FAMILY
def test_chunk_loss_equals_hf_head_with_lora(family, family_processor):
    model = _lora_model([f"model.name={family}"])
    batch = make_batch(family_processor, images_per_sample=(1, 0, 2))
    model.configure_loss(chunk=False)
    ref_loss, ref_grads = _loss_and_grads(model, batch)
    model.configure_loss(chunk=True, chunk_size=7)
    loss, grads = _loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, **FP32)
    assert grads.keys() == ref_grads.keys() and any(".lora_A." in k for k in grads)
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], **FP32, msg=lambda m, k=k: f"{k}: {m}")
    assert model.lm_head.weight.grad is None


def test_adapter_init_is_peft_default_and_per_seed():
    a, b, c = _lora_model(seed=3), _lora_model(seed=3), _lora_model(seed=4)
    init_a = lora.initial_adapters(a, 3)
    assert init_a.keys() and all(torch.equal(v, lora.initial_adapters(b, 3)[k]) for k, v in init_a.items())
    assert not all(torch.equal(v, lora.initial_adapters(c, 4)[k]) for k, v in init_a.items())
    assert all(not v.any() for k, v in init_a.items() if ".lora_B." in k)


def test_parameter_counts_list_adapters_per_part():
    counts = registry.parameter_counts(_lora_model(["lora.vision=true"]))
    assert counts["language model"]["adapters"] > 0 and counts["vision blocks"]["adapters"] > 0
    assert counts["lm_head"]["adapters"] == counts["lm_head"]["trainable"] == 0
    assert counts["merger"]["trainable"] == counts["merger"]["total"]  # saved module: trained fully
    lm = counts["language model"]
    assert lm["trainable"] == lm["adapters"] < lm["total"]


# ---------------------------------------------------------------------------------------------
# Resume, parameter groups, export (one process)

GROUPS = [
    "train.param_groups=[{pattern: model.visual.merger, lr: 1.0e-3, weight_decay: 0.5}]",
    "train.no_decay=true", "train.weight_decay=0.1", "train.steps=6", "checkpoint.save_final=true",
]  # fmt: skip


def _resume_runs(rank, out, processor_path, family):
    from qwenkit.model.processor import Processor

    dist.init_process_group("gloo")
    seen = {}
    for name, extra in (("A", []), ("B", ["train.stop_after=3"]), ("B", [])):
        cfg = qconfig.load(overrides=[*BASE, *LORA, *GROUPS, *extra, f"train.output_dir={out / name}", "train.resume=auto",
                                      f"model.name={family}", *RESUME_FAMILIES[family]])  # fmt: skip
        trainer = train.Trainer(cfg)
        recorded = {}
        trainer_setup = trainer.setup

        def setup(trainer=trainer, trainer_setup=trainer_setup, recorded=recorded):
            trainer_setup()
            recorded["applied"] = record_applied(trainer.optimizer)

        trainer.setup = setup
        trainer.run()
        applied = [a["groups"] for a in recorded["applied"]]
        seen.setdefault(name, []).append({"losses": [h["loss"] for h in trainer.history], "applied": applied,
                                          "logged": [{k: v for k, v in h.items() if k.startswith("lr")} for h in trainer.history]})  # fmt: skip
    model = trainer.model
    model.configure_loss(chunk=False)
    model.eval()
    batch = make_batch(Processor.from_pretrained(processor_path), seed=5)
    batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch).logits
    torch.save({"seen": seen, "batch": batch, "logits": logits}, out / "result.pt")
    dist.destroy_process_group()


# the resume and export proofs for Qwen2.5-VL and for Qwen3-VL-MoE (DeepStack, the router's aux loss;
# LoRA on attention and, lora.target_experts, on the experts' fused weights: peft's target_parameters);
# the dense Qwen3-VL export is the acceptance's. family -> its LoRA overrides
# the Omni thinkers as their dense and MoE peers (the audio tower stays out of LoRA's towers)
RESUME_FAMILIES = {"qwen2_5_vl": [], "qwen3_vl_moe": ["lora.target_experts=true"], "qwen2_5_omni": [],
                   "qwen3_omni_moe": ["lora.target_experts=true"]}  # fmt: skip


@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.skipif(bool(why := families.get(f).unavailable()),
                                                                                  reason=why or ""))
                                        for f in RESUME_FAMILIES])  # fmt: skip
def resumed(request, tmp_path_factory, _cache):
    family = request.param
    out = tmp_path_factory.mktemp(f"resume-{family}")
    check_ranks(_resume_runs, 1, out, tiny_checkpoint(family), family, timeout=600)
    return out, torch.load(out / "result.pt"), family


@pytest.mark.slow
@pytest.mark.stack
def test_resume_is_bit_identical_with_lora(resumed):
    seen = resumed[1]["seen"]
    a, (b1, b2) = seen["A"][0], seen["B"]
    assert len(a["losses"]) == 6 and b1["losses"] == a["losses"][:3]
    assert b2["losses"] == a["losses"][3:]  # exact


@pytest.mark.slow
@pytest.mark.stack
def test_param_groups_get_their_lrs_also_after_resume(resumed):
    seen = resumed[1]["seen"]
    a, b2 = seen["A"][0], seen["B"][1]
    factors = [optim.lr_factor(s, 1, 6, qconfig.TrainConfig().min_lr_ratio) for s in range(1, 7)]
    # read from the optimizer before each step: the LR that step applies (the scheduler moves it after)
    for step, applied in enumerate(a["applied"], start=1):
        f = factors[step - 1]
        # LoRA's A and B are matrices: the default group has no bias, norm or embedding to exempt
        assert set(applied) == {"default", "model.visual.merger", "model.visual.merger (no decay)"}
        assert applied["default"] == pytest.approx((1e-2 * f, 0.1))
        assert applied["model.visual.merger"] == pytest.approx((1e-3 * f, 0.5))
        assert applied["model.visual.merger (no decay)"] == pytest.approx((1e-3 * f, 0.0))
    assert b2["applied"] == a["applied"][3:]
    assert [h["lr/model.visual.merger"] for h in a["logged"]] == pytest.approx([1e-3 * f for f in factors])


@pytest.mark.slow
@pytest.mark.stack
def test_checkpoint_holds_only_what_trains(resumed):
    import torch.distributed.checkpoint as dcp

    step = resumed[0] / "A" / "checkpoints" / "step-00000006"
    keys = [k for k in dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all(lora.is_adapter_key(k) or k.startswith("model.model.visual.merger.") for k in keys)


@pytest.mark.slow
@pytest.mark.stack
def test_export_loads_in_peft_and_merged_with_qwenkits_logits(resumed, tmp_path):
    from peft import PeftModel

    out, result, family = resumed
    tiny_path, hf_class = tiny_checkpoint(family), families.get(family).load("hf_class")
    cfg = qconfig.load(out / "B" / "config.yaml")
    adapter = hf_export.export(out / "B", tmp_path / "adapter", cfg)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_path)
    for name in ("adapter_model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert (adapter / name).is_file(), name
    from safetensors import safe_open

    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:  # lora.target_experts: the experts' adapters too
        assert any(".mlp.experts." in k for k in f.keys()) == ("lora.target_experts=true" in RESUME_FAMILIES[family])
    base = hf_class.from_pretrained(tiny_path)
    model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        logits = model(**result["batch"]).logits
    torch.testing.assert_close(logits, result["logits"], **FP32)

    merged = hf_export.export(out / "B", tmp_path / "merged", cfg, merge=True)
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    model = hf_class.from_pretrained(merged).eval()
    with torch.no_grad():
        logits = model(**result["batch"]).logits
    torch.testing.assert_close(logits, result["logits"], **FP32)


# ---------------------------------------------------------------------------------------------
# Config checks and the command line


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lora.r=4", "lora.target_modules=[q_proj, qkv]"], "'qkv' matches no linear layer of the language model"),
        (["lora.r=4", "lora.modules_to_save=[model.visual.mergr]"], "no module 'model.visual.mergr'"),
        (["lora.r=4", "lora.target_experts=true"], "lora.target_experts=true: qwen2_5_vl has no routed experts to adapt"),
        (["train.param_groups=[{pattern: model.visual.block.*, lr: 1.0}]"], "'model.visual.block.*' matches no module"),
    ],
)
def test_targets_that_match_nothing_are_named_before_spawning(tmp_path, monkeypatch, capsys, overrides, message):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("spawned"))
    code = launch.launch(None, [*overrides, f"train.output_dir={tmp_path}"])
    assert code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lora.vision=true"], "lora.vision set but lora.r=0"),
        (["lora.r=4", "lora.dropout=1.0"], "lora.dropout must be in [0, 1)"),
        (["lora.r=4", "lora.target_modules=[lm_head]"], "lm_head computes the chunked loss"),
        (["lora.r=4", "lora.use_dora=true", "model.init_device=meta"], "lora.use_dora=true needs model.init_device=cpu"),
        (["train.param_groups=[{pattern: model.visual.merger, lr: 0}]"], "train.param_groups[0].lr must be > 0"),
        (["train.param_groups=[{pattern: x, lr: 1.0, wd: 0}]"], "unknown key 'train.param_groups[0].wd'"),
    ],
)
def test_bad_lora_and_group_keys_are_refused(overrides, message):
    with pytest.raises(qconfig.ConfigError) as e:
        qconfig.load(overrides=overrides)
    assert message in str(e.value)


def _qwenkit(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "qwenkit.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.slow
def test_qwenkit_train_lora_export_and_eval(tmp_path, capsys):
    """``qwenkit train`` in a process of its own (2 ranks); ``export`` and ``eval`` through the same
    entry point in this one (their own process boundary: tests/engine/generation/test_evaluate.py, tests/test_launch.py)."""
    from qwenkit import cli

    out = tmp_path / "run"
    small = ["train.steps=3", "data.tiny_samples=16", "checkpoint.every=0", "data.tiny_eval_samples=4", "train.eval_samples=2"]
    proc = _qwenkit("train", "--config", "params/tiny_cpu.yaml", "--master-port", str(free_port()), "lora.r=8",
                    *small, f"train.output_dir={out}")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LoRA r=8 on" in proc.stderr and "adapters" in proc.stderr

    def qwenkit(*args):
        code = cli.main(list(args))
        captured = capsys.readouterr()
        assert code == 0, captured.err
        return captured.out

    qwenkit("export", str(out), str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    run_eval = qwenkit("eval", str(out), "--samples", "2")
    adapter_eval = qwenkit("eval", str(tmp_path / "adapter"), "--samples", "2", "--config", str(out / "config.yaml"))
    lines = [line for line in run_eval.splitlines() if line.startswith(("eval_loss", "eval_accuracy"))]
    assert lines and lines == [line for line in adapter_eval.splitlines() if line.startswith(("eval_loss", "eval_accuracy"))]
    # the trainer's own evaluation of the sharded LoRA model at the last step gives the same numbers
    logged = {m: metrics.series(metrics.read(out / "metrics" / "rank-00000.jsonl"), m)[3] for m in ("eval_loss", "eval_accuracy")}
    assert f"eval_loss {logged['eval_loss']:.4f}" in run_eval
    assert f"eval_accuracy {logged['eval_accuracy']:.4f}" in run_eval


# ---------------------------------------------------------------------------------------------
# Generation's copy leaves the training model alone


def _copy_for_generation(model, rank):
    """The merged copy eval accuracy generates with, built from the trained ``model`` (collective):
    which of the model's full tensors it changed (on one rank they are the parameters themselves)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from qwenkit.engine.generation import placement

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    before = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    copy = placement.unsharded_copy(model, Qwen2_5_VLForConditionalGeneration, torch.device("cpu"), rank == 0)
    after = get_model_state_dict(model, options=full)
    if rank != 0:
        return {}
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    return {"copy_changed": changed, "copy_params": sum(p.numel() for p in copy.parameters())}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_generation_copy_leaves_the_training_model_unchanged(runs, world):
    """Eval accuracy mid-run builds a merged copy for generation: on one CPU rank the gathered
    full tensors are the training parameters themselves, so merging the adapters into the copy
    must not write into them (it did: every later step of a 1-rank LoRA run with a mid-run
    eval_accuracy changed). The ``lora`` runs of the fixture above, after training."""
    got = runs[world - 1]["lora"]
    assert got["copy_params"] > 0
    assert got["copy_changed"] == [], got["copy_changed"][:5]
