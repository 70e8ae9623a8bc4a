"""train.objective=dpo through the trainer: the model's per-sequence log-probs equal HF's full logits;
the disabled-adapter reference equals a separate frozen base; 2-rank runs check that 2 ranks equal
1 process and that the precomputed reference trains as the on-the-fly frozen copy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from multiproc import check_ranks, free_port, scaled
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.engine import init_from, metrics, preference, stopping, train
from qwenkit.model import lora, paths, registry
from qwenkit.model.loss import full_sequence_logps

ROOT = Path(__file__).resolve().parent.parent
# max_grad_norm=0: compare the updates themselves, not clipping (whose norm is an all-reduce)
BASE = ["train.objective=dpo", "data.tiny_samples=16", "data.tiny_eval_samples=4", "train.steps=3",
        "train.resume=none", "train.max_grad_norm=0", "train.lr=0.01", "train.warmup_steps=0"]  # fmt: skip
LOGGED = ("loss", *preference.METRICS)
FP32 = dict(rtol=1e-5, atol=1e-6)


def _batch(cfg, processor, pairs=(0, 1)):
    bundle = data.build(cfg, processor)
    batch = bundle.collator([bundle.dataset[p] for p in pairs])
    for key in (*preference.PAIR_KEYS, "num_items", "num_samples"):
        batch.pop(key)
    return batch


@pytest.mark.parametrize("tied", [False, True])
def test_model_sequence_logps_equal_hf_full_logits_with_images_and_their_grads(processor, tied):
    cfg = qconfig.load(overrides=BASE + [f"model.tie_word_embeddings={str(tied).lower()}"])
    model = registry.build(cfg.model, cfg.loss)
    batch = _batch(cfg, processor, pairs=(0, 1, 2))  # rows of three layouts, with images
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
    for a, b in zip(got, want):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, **FP32)


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


def _worker(rank, out, name, extra):
    """One training run per process (a fresh process per run, as qwenkit train starts one)."""
    dist.init_process_group("gloo")
    cfg = qconfig.load(overrides=BASE + extra + [f"train.output_dir={out / name}"])
    trainer = train.run(cfg)
    if rank == 0:
        rows = [{k: h[k] for k in LOGGED} for h in trainer.history]
        (out / f"{name}.json").write_text(json.dumps({"history": rows, "evals": trainer.evals}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def out(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("dpo")
    paths.resolve_path(qconfig.load().model)  # the tiny checkpoint before the ranks start
    two = ["train.micro_batch_size=2"]
    check_ranks(_worker, 2, out, "copy-2", two)
    check_ranks(_worker, 1, out, "copy-1", ["train.micro_batch_size=4"])  # one global batch
    check_ranks(_worker, 2, out, "precomputed-2", two + ["dpo.precompute_ref=true"])
    # copy-2 again through `qwenkit train` (launcher, torchrun, the dpo.* keys as overrides),
    # stopped after step 2 with a checkpoint, then resumed to step 3 by the same command
    cli = ["train", "--nproc", "2", *BASE, *two, "train.resume=auto", "parallel.allow_oversubscribe=true", f"train.output_dir={out / 'resumed-2'}"]
    for extra, code in ((["train.stop_after=2"], stopping.EXIT_RESUMABLE), ([], 0)):
        proc = _qwenkit(*cli, "--master-port", str(free_port()), *extra)
        assert proc.returncode == code, proc.stdout + proc.stderr
    return out


def _qwenkit(*args):
    return subprocess.run([sys.executable, "-m", "qwenkit.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(600))  # fmt: skip


def _read(out, name):
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
def test_two_ranks_equal_one_process(out):
    two, one = _read(out, "copy-2"), _read(out, "copy-1")
    for a, b in zip(two["history"] + two["evals"], one["history"] + one["evals"]):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_precomputed_reference_trains_as_the_frozen_copy(out):
    copy, pre = _read(out, "copy-2"), _read(out, "precomputed-2")
    for a, b in zip(copy["history"] + copy["evals"], pre["history"] + pre["evals"]):
        for key in a:  # the tables come from other batch shapes (padding): fp32 rounding only
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_the_policy_starts_as_its_reference(out):
    evals, history = _read(out, "copy-2")["evals"], _read(out, "copy-2")["history"]
    assert evals[0]["eval_rewards/margins"] == 0.0
    assert history[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # log 2: no preference yet


def _final_state(run: Path) -> dict:
    """The model and optimizer tensors of a run's step-3 checkpoint, gathered from its DCP shards."""
    dcp_to_torch_save(run / "checkpoints" / "step-00000003", run / "final.pt")
    return torch.load(run / "final.pt", weights_only=False)


@pytest.mark.slow
def test_stopped_and_resumed_through_qwenkit_train_equals_the_uninterrupted_run_bit_for_bit(out):
    """The resumed run's steps, eval and final weights and optimizer moments equal the in-process run's exactly."""
    rows = metrics.read(out / "resumed-2" / "metrics" / "rank-00000.jsonl")
    resumed = {(r["x"], r["metric"]): r["value"] for r in rows}
    copy = _read(out, "copy-2")
    for step, logged in enumerate(copy["history"], 1):  # steps 1-2 by the stopped run, 3 by the resumed one
        for key in LOGGED:
            assert resumed[(step, key)] == logged[key], (step, key)
    for key, value in copy["evals"][-1].items():
        if key != "step":
            assert resumed[(3, key)] == value, key
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


def _model_cfg(**kw):
    return qconfig.load(overrides=[f"model.{k}={v}" for k, v in kw.items()])


def test_init_from_refuses_a_run_without_checkpoint_in_one_line(tmp_path, capsys):
    cfg = _model_cfg(init_from=tmp_path / "none")
    assert init_from.prepare(cfg, train_recipe=None) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"model.init_from='{tmp_path / 'none'}': no complete checkpoint there" in err
    cfg = _model_cfg(init_from=tmp_path / "none", init_recipe=tmp_path / "missing.yaml")
    assert init_from.prepare(cfg, train_recipe=None) == 2
    assert "model.init_recipe=" in capsys.readouterr().err and cfg.model.path == "tiny"


def test_init_from_trains_the_recipe_when_the_run_is_missing_and_stops_when_that_fails(tmp_path, capsys):
    recipe = tmp_path / "sft.yaml"
    recipe.write_text("train:\n  steps: 2\n")
    asked = []
    cfg = _model_cfg(init_from=tmp_path / "sft", init_recipe=recipe)
    assert init_from.prepare(cfg, lambda params, extra: asked.append((params, extra)) or 75) == 75
    assert asked == [(str(recipe), [f"train.output_dir={tmp_path / 'sft'}"])]
    assert "did not finish (exit 75)" in capsys.readouterr().err and cfg.model.path == "tiny"


@pytest.mark.slow
def test_init_from_a_run_exports_its_newest_checkpoint_once_and_starts_there(out):
    cfg = _model_cfg(init_from=out / "copy-2")
    assert init_from.prepare(cfg, train_recipe=None) is None
    start = out / "copy-2" / "hf-step-00000003"
    assert cfg.model.path == str(start) and (start / "config.json").is_file()
    made = (start / "config.json").stat().st_mtime_ns
    again = _model_cfg(init_from=out / "copy-2")
    assert init_from.prepare(again, train_recipe=None) is None and (start / "config.json").stat().st_mtime_ns == made
    model = registry.build(cfg.model, cfg.loss)  # the trainer's build: the DPO run's weights at step 3
    saved = _final_state(out / "copy-2")["model"]
    for name, p in model.state_dict().items():
        assert torch.equal(p, saved[name]), name
