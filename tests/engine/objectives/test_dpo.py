"""train.objective=dpo through the trainer: the model's per-sequence log-probs equal HF's full logits;
the disabled-adapter reference equals a separate frozen base; the runs of one module fixture check
that 2 ranks equal 1 process (with accumulation and recompute), that the precomputed reference
trains as the on-the-fly frozen copy, that a run resumed through ``qwenkit train`` is bit-identical,
that ``model.init_from`` trains, exports and starts from its SFT run, and that the frozen copy under
mixed precision keeps bf16 shards with the same log-probs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import EVERY_FAMILY, families_allowing
from model.families.test_chunked import _video_batch
from multiproc import check_ranks, free_port, scaled
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from qwenkit import cli, data
from qwenkit import config as qconfig
from qwenkit.distributed import fsdp
from qwenkit.engine.checkpoints import init_from
from qwenkit.engine.objectives import dpo as preference
from qwenkit.engine.run import metrics, train
from qwenkit.model import lora
from qwenkit.model.families import build as registry
from qwenkit.model.losses.logps import full_sequence_logps
from qwenkit.sweep import file as sweep_file

ROOT = Path(__file__).resolve().parents[2]
# max_grad_norm=0: compare the updates themselves, not clipping (whose norm is an all-reduce)
BASE = ["train.objective=dpo", "data.tiny_samples=16", "data.tiny_eval_samples=4", "train.steps=3",
        "train.resume=none", "train.max_grad_norm=0", "train.lr=0.01", "train.warmup_steps=0"]  # fmt: skip
LOGGED = ("loss", "grad_norm", *preference.METRICS)
RECOMPUTE = "parallel.recompute=[model.language_model.layers.*, model.visual.blocks.*]"
FP32 = dict(rtol=1e-5, atol=1e-6)


def _batch(cfg, processor, pairs=(0, 1)):
    bundle = data.build(cfg, processor)
    batch = bundle.collator([bundle.dataset[p] for p in pairs])
    for key in (*preference.PAIR_KEYS, "num_items", "num_samples"):
        batch.pop(key)
    return batch


@EVERY_FAMILY
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("media", ["images", "video"])
def test_model_sequence_logps_equal_hf_full_logits_and_their_grads(family, family_path, family_processor, tied, media):
    model_keys = [f"model.name={family}", f"model.path={family_path}", f"model.tie_word_embeddings={str(tied).lower()}"]
    cfg = qconfig.load(overrides=BASE + model_keys)
    model = registry.build(cfg.model, cfg.loss)
    if media == "images":  # the preference rows of three layouts, with images (text-only prompts among them)
        batch = _batch(cfg, family_processor, pairs=(0, 1, 2))
    else:  # a text + video sequence (Qwen3-VL: a timestamp before each frame group)
        batch = _video_batch(family_processor, family)
    sums, counts = model.sequence_logps(**batch)
    model.chunk_loss = False  # HF's own forward: full [B, S, V] logits
    ref, ref_counts = full_sequence_logps(model(**{k: v for k, v in batch.items() if k != "labels"}).logits,
                                          batch["labels"])  # fmt: skip
    torch.testing.assert_close(sums, ref, **FP32)
    assert counts.tolist() == ref_counts.tolist() and min(counts.tolist()) > 0
    g = torch.linspace(-1, 1, sums.shape[0])  # a per-sequence upstream gradient, as DPO's
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad((sums * g).sum(), params, allow_unused=True)
    model.chunk_loss = True
    want = torch.autograd.grad((ref * g).sum(), params, allow_unused=True)
    for a, b in zip(got, want):  # each a sum over the sequence's tokens: fp32's rounding grows with their count
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@families_allowing("DPO")
def test_dpo_trains_every_family_from_its_own_start(family, family_path, tmp_path):
    """One process, the frozen copy as reference: the policy starts as its reference, so step 0's
    held-out rewards are exactly 0 and the first loss is sigmoid DPO's log 2 (no SFT term here)."""
    out = tmp_path / "run"
    cfg = qconfig.load(overrides=BASE + [
        f"model.name={family}", f"model.path={family_path}", "data.tiny_samples=8", "train.steps=2",
        "train.eval_every=2", "train.micro_batch_size=2", "dpo.sft_weight=0", "checkpoint.save_final=false",
        f"train.output_dir={out}",
    ])  # fmt: skip
    train.run(cfg)
    run = _read(tmp_path, "run")
    assert [sorted(h) for h in run["history"]] == [sorted(LOGGED)] * 2
    assert run["history"][0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert all(math.isfinite(v) for h in run["history"] for v in h.values())
    first, last = run["evals"][0], run["evals"][-1]
    assert (first["step"], last["step"]) == (0, 2)
    assert first["eval_rewards/margins"] == 0 and first["eval_rewards/chosen"] == 0
    assert last["eval_rewards/margins"] != 0  # two steps moved the policy off its reference


def test_disabled_adapters_give_the_frozen_base_and_enabled_ones_do_not(processor):
    cfg = qconfig.load(overrides=BASE + ["lora.r=8"])
    base = registry.build(cfg.model, cfg.loss)
    policy = registry.build(cfg.model, cfg.loss)
    lora.apply(policy, cfg.lora, seed=0)
    with torch.no_grad():  # trained adapters: B != 0, so the policy differs from its base
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    batch = _batch(cfg, processor)
    want, _ = base.sequence_logps(**batch)
    c, r = preference.Reference("adapters")(policy, batch, torch.tensor([0, 1]))
    torch.testing.assert_close(torch.cat([c, r]), want, rtol=0, atol=0)
    adapted, _ = policy.sequence_logps(**batch)
    assert (adapted - want).abs().min() > 1e-3  # the adapters are back on after the block


SFT_RECIPE = """\
# the SFT start model.init_from trains first: qwenkit train --config this train.output_dir=<init_from>
data: {tiny_samples: 16}
parallel: {nproc: 1}
train: {steps: 1, micro_batch_size: 4, lr: 0.01, warmup_steps: 0, resume: none}
"""
# the mixed-precision run beside the precomputed one (same process group): its frozen copy
BF16 = ["parallel.param_dtype=bfloat16", "parallel.reduce_dtype=float32", "checkpoint.save_final=false"]


def _worker(rank, out, runs):
    """``runs``: ``(name, overrides)`` trained one after another in this process group."""
    dist.init_process_group("gloo")
    for name, extra in runs:
        cfg = qconfig.load(overrides=BASE + extra + [f"train.output_dir={out / name}"])
        trainer = train.run(cfg)
        if "parallel.param_dtype=bfloat16" in extra:
            _reference_dtypes(rank, out / f"{name}.json", cfg, trainer)
    dist.destroy_process_group()


def _reference_dtypes(rank, file, cfg, trainer):
    """The run's frozen copy under bf16 mixed precision against one stored in fp32 and cast at each all-gather
    (built by hand as before): its shard dtype and bytes, and its log-probs of a batch."""
    ref = trainer.objective.reference.model
    by_hand = registry.build(cfg.model, cfg.loss).requires_grad_(False)
    fsdp.shard(by_hand, cfg.parallel, fsdp.build_mesh(trainer.rt, cfg.parallel.hsdp_replicas))
    preference.enable(by_hand).eval()
    by_hand.vision_calls_per_step = ref.vision_calls_per_step
    bundle = trainer.bundle
    batch = bundle.collator([bundle.dataset[p] for p in (2 * rank, 2 * rank + 1)])
    batch = {k: v for k, v in batch.items() if k not in (*preference.PAIR_KEYS, "num_items", "num_samples", "num_bad")}
    with torch.no_grad():
        got, want = ref.sequence_logps(**batch)[0], by_hand.sequence_logps(**batch)[0]
    # after a forward without backward: the copy's root resharded itself; these two keep theirs gathered
    sharded = all(isinstance(p, DTensor) for p in ref.parameters())
    by_hand.reshard(), trainer.model.reshard()
    shard_bytes = lambda m: sum(p.to_local().numel() * p.element_size() for p in m.parameters())  # noqa: E731
    if rank == 0:
        file.write_text(json.dumps({"sharded": sharded} if not sharded else {"sharded": sharded,
            "equal": torch.equal(got, want), "logps": got.tolist(), "dtypes": sorted({str(p.dtype) for p in ref.parameters()}),
            "bytes": shard_bytes(ref), "fp32_bytes": shard_bytes(by_hand), "policy_bytes": shard_bytes(trainer.model),
            "buffers": {n: str(b.dtype) for n, b in ref.named_buffers()} == {n: str(b.dtype) for n, b in by_hand.named_buffers()},
        }))  # fmt: skip


@pytest.fixture(scope="module")
def out(tmp_path_factory, tiny_path):
    """Four launches. copy-2 goes through ``qwenkit train`` (launcher, torchrun, the dpo.* keys as overrides)
    from ``model.init_from`` with no checkpoint yet: its recipe trains the SFT start first (1 rank, 1 step),
    which is exported and trained from; copy-2 saves step 2 and 3. resumed-2: the same command resumed from
    copy-2's step 2 (the export reused). Then, in-process from the same start: copy-1 (1 rank, grad
    accumulation and recompute) and, in one 2-rank process group, precomputed-2 (the table written by
    this run: its own cache dir) and bf16-2 (mixed precision)."""
    out = tmp_path_factory.mktemp("dpo")
    (out / "sft.yaml").write_text(SFT_RECIPE)
    cli = ["train", *BASE, "train.micro_batch_size=2", "parallel.nproc=2", "parallel.allow_oversubscribe=true",
           f"model.init_from={out / 'sft'}"]  # fmt: skip
    said = {}
    for name, extra in (("copy-2", [f"model.init_recipe={out / 'sft.yaml'}", "checkpoint.every=2"]),
                        ("resumed-2", [f"train.resume={out / 'copy-2' / 'checkpoints' / 'step-00000002'}"])):  # fmt: skip
        proc = _qwenkit(*cli, *extra, f"train.output_dir={out / name}", "--master-port", str(free_port()))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        said[name] = proc.stdout
    (out / "said.json").write_text(json.dumps(said))
    start = [f"model.path={qconfig.load(out / 'copy-2' / 'config.yaml').model.path}"]
    check_ranks(_worker, 1, out, [("copy-1", start + ["train.micro_batch_size=2", "train.grad_accum=2", RECOMPUTE])])
    two = start + ["train.micro_batch_size=2"]
    check_ranks(_worker, 2, out, [("precomputed-2", two + ["dpo.precompute_ref=true", f"data.cache_dir={out / 'cache'}"]),
                                  ("bf16-2", two + BF16)])  # fmt: skip
    return out


def _qwenkit(*args):
    return subprocess.run([sys.executable, "-m", "qwenkit.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(600))  # fmt: skip


def _read(out, name):
    """A run's logged steps and evaluations (rank 0's metrics file), in step order."""
    rows = metrics.read(out / name / "metrics" / "rank-00000.jsonl")
    steps, evals = {}, {}
    for r in rows:
        if r["metric"] in LOGGED:
            steps.setdefault(r["x"], {})[r["metric"]] = r["value"]
        elif r["metric"].startswith("eval_"):
            evals.setdefault(r["x"], {"step": r["x"]})[r["metric"]] = r["value"]
    return {"history": [steps[k] for k in sorted(steps)], "evals": [evals[k] for k in sorted(evals)]}


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_accumulation_and_recompute(out):
    two, one = _read(out, "copy-2"), _read(out, "copy-1")
    assert len(two["history"]) == 3 and len(two["evals"]) == 2
    for a, b in zip(two["history"] + two["evals"], one["history"] + one["evals"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_precomputed_reference_trains_as_the_frozen_copy(out):
    """The table is written by this run's pass (its own cache dir): a pass that left the root gathered
    gave the optimizer unsharded tensors (grad_norm off at step 1, then the losses; the save failed)."""
    assert len(list((out / "cache").glob("**/ref-logps-*.pt"))) == 2  # train and eval pairs
    copy, pre = _read(out, "copy-2"), _read(out, "precomputed-2")
    for a, b in zip(copy["history"] + copy["evals"], pre["history"] + pre["evals"], strict=True):
        for key in a:  # the tables come from other batch shapes (padding): fp32 rounding only
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert (out / "precomputed-2" / "checkpoints" / "step-00000003" / ".metadata").is_file()


@pytest.mark.slow
def test_the_frozen_copy_keeps_its_shards_in_the_compute_dtype_with_the_same_log_probs(out):
    """Under parallel.param_dtype=bfloat16 the copy's shards are bf16 (half the fp32 policy's bytes) and its
    log-probs equal, bit for bit, those of a copy stored in fp32 and cast by FSDP2 at each all-gather."""
    got = json.loads((out / "bf16-2.json").read_text())
    assert got["sharded"]  # its root is not left gathered after a forward (no backward frees it)
    assert got["dtypes"] == ["torch.bfloat16"] and got["buffers"]
    assert got["bytes"] * 2 == got["fp32_bytes"] == got["policy_bytes"]
    assert got["equal"], got["logps"]
    bf16 = _read(out, "bf16-2")  # in the run: the fp32-stored policy and the bf16 copy, both gathered in bf16,
    start = bf16["evals"][0]  # give the same bits at step 0 (rewards exactly 0), then it trains
    assert start["eval_rewards/chosen"] == start["eval_rewards/rejected"] == 0.0
    assert len(bf16["history"]) == 3 and all(math.isfinite(h["loss"]) for h in bf16["history"])


@pytest.mark.slow
def test_the_policy_starts_as_its_reference(out):
    evals, history = _read(out, "copy-2")["evals"], _read(out, "copy-2")["history"]
    assert evals[0]["eval_rewards/margins"] == 0.0
    assert history[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # log 2: no preference yet


def _final_state(run: Path) -> dict:
    """The model and optimizer tensors of a run's newest checkpoint, gathered from its DCP shards."""
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    dcp_to_torch_save(ckpt, run / f"{ckpt.name}.pt")
    return torch.load(run / f"{ckpt.name}.pt", weights_only=False)


@pytest.mark.slow
def test_resumed_through_qwenkit_train_equals_the_uninterrupted_run_bit_for_bit(out):
    """The run resumed from step 2 logs copy-2's step 3 and eval, and ends with its weights and AdamW moments, exactly."""
    resumed, copy = _read(out, "resumed-2"), _read(out, "copy-2")
    assert resumed["history"] == copy["history"][2:] and resumed["evals"] == copy["evals"][-1:]
    want, got = _final_state(out / "copy-2"), _final_state(out / "resumed-2")
    flat = lambda d, pre="": {k: v for key, sub in d.items() for k, v in (flat(sub, f"{pre}{key}.").items()  # noqa: E731
                              if isinstance(sub, dict) else [(f"{pre}{key}", sub)])}  # fmt: skip
    want, got = flat(want), flat(got)
    assert want.keys() == got.keys() and any(k.startswith("optimizer.state.") for k in want)
    for key in want:
        if isinstance(want[key], torch.Tensor):
            assert torch.equal(want[key], got[key]), key
        else:
            assert want[key] == got[key], key


@pytest.mark.slow
def test_the_resumed_run_exports_to_hf_and_qwenkit_eval_prints_the_trainers_eval_metrics(out, tmp_path):
    run = out / "resumed-2"
    exported = _qwenkit("export", str(run), str(tmp_path / "hf"))
    assert exported.returncode == 0, exported.stderr
    from transformers import Qwen2_5_VLForConditionalGeneration

    Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf")
    evaluated = _qwenkit("eval", str(run))  # the run's held-out pairs, HF's full logits in one process
    assert evaluated.returncode == 0, evaluated.stderr
    printed = dict(line.split(" ", 1) for line in evaluated.stdout.splitlines() if line.startswith("eval_"))
    logged = _read(out, "copy-2")["evals"][-1]  # the trainer's eval at step 3 (sharded, chunked head)
    assert printed.keys() == {k for k in logged if k != "step"}
    for key, value in logged.items():
        if key != "step":  # printed to 4 decimals; fp32 sums of other shapes below that
            assert float(printed[key]) == pytest.approx(value, abs=1.5e-4), key
    first = _qwenkit("eval", str(run), "--samples", "2")  # the first pairs only (the option was ignored)
    assert first.returncode == 0 and "pairs: 2" in first.stdout, first.stderr


def _model_cfg(**kw):
    return qconfig.load(overrides=[f"model.{k}={v}" for k, v in kw.items()])


@pytest.mark.parametrize("model_keys, said", [
    ({"init_from": "none"}, "model.init_from='{tmp}/none': no complete checkpoint there; train that run first, or set "
                            "model.init_recipe"),
    ({"init_from": "none", "init_recipe": "missing.yaml"}, "model.init_recipe='{tmp}/missing.yaml' is not a file"),
    ({"init_recipe": "missing.yaml"}, "model.init_recipe is set but model.init_from is not"),
])  # fmt: skip
def test_qwenkit_train_refuses_a_start_it_cannot_make_in_one_line_before_any_rank(tmp_path, capsys, model_keys, said):
    args = [f"model.{k}={tmp_path / v}" for k, v in model_keys.items()]
    assert cli.main(["train", *args, f"train.output_dir={tmp_path / 'dpo'}", "train.objective=dpo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("qwenkit train: ") and said.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "dpo").exists()  # nothing written, nothing started


def test_init_from_trains_the_recipe_when_the_run_is_missing_and_stops_when_that_fails(tmp_path, capsys):
    recipe = tmp_path / "sft.yaml"
    recipe.write_text("train:\n  steps: 2\n")
    asked = []
    cfg = _model_cfg(init_from=tmp_path / "sft", init_recipe=recipe)
    assert init_from.prepare(cfg, lambda params, extra: asked.append((params, extra)) or 75) == 75
    assert asked == [(str(recipe), [f"train.output_dir={tmp_path / 'sft'}"])]
    assert "did not finish (exit 75)" in capsys.readouterr().err and cfg.model.path == "tiny"


@pytest.mark.slow
def test_qwenkit_train_trains_the_missing_start_with_its_recipe_exports_it_once_and_starts_there(out):
    """copy-2's launch trained model.init_from with its recipe (its own 1 rank, 1 step), exported the step
    and trained from it; resumed-2's launch found the export and did not write it again."""
    said = json.loads((out / "said.json").read_text())
    sft = qconfig.load(out / "sft" / "config.yaml")
    assert sft.train.steps == 1 and sft.parallel.nproc == 1 and sft.train.objective == "sft"
    ckpt = out / "sft" / "checkpoints" / "step-00000001"
    start = init_from.export_dir(ckpt)
    assert f"training it first with {out / 'sft.yaml'}" in said["copy-2"] and f"exported {ckpt} to {start}" in said["copy-2"]
    assert "training it first" not in said["resumed-2"] and "exported" not in said["resumed-2"]
    for run in ("copy-2", "resumed-2"):  # the run's record names the weights it started from
        assert qconfig.load(out / run / "config.yaml").model.path == str(start)
    model = registry.build(_model_cfg(path=start).model, sft.loss)  # the trainer's build of the start
    saved = _final_state(out / "sft")["model"]
    assert model.state_dict().keys() == saved.keys()
    for name, p in model.state_dict().items():
        assert torch.equal(p, saved[name]), name


def test_a_sweep_grids_dpo_beta_and_refuses_a_bad_value_naming_the_trial(tmp_path):
    """Every trial is a validated dpo config before the first starts (qwenkit.sweep.file)."""
    path = tmp_path / "beta.yaml"
    path.write_text("overrides: [train.objective=dpo, train.steps=2]\ngrid: {dpo.beta: [0.1, 0.5], dpo.loss: [sigmoid, ipo]}\n")
    trials = sweep_file.load(path, tmp_path / "out").trials
    assert [(t.cfg.train.objective, t.cfg.dpo.beta, t.cfg.dpo.loss) for t in trials] == [
        ("dpo", 0.1, "sigmoid"), ("dpo", 0.1, "ipo"), ("dpo", 0.5, "sigmoid"), ("dpo", 0.5, "ipo")]  # fmt: skip
    assert len({t.output_dir for t in trials}) == 4
    path.write_text(path.read_text().replace("[0.1, 0.5]", "[0.1, 0]"))
    with pytest.raises(sweep_file.SweepError, match=r"trial 3 \(.*\): dpo\.beta must be > 0, got 0"):
        sweep_file.load(path, tmp_path / "out")
