"""Checkpoints on 2 gloo ranks: bit-identical resume, a killed save, a corrupt one, export to HF.

Two job launches share the work (each launch costs seconds of imports on 2 cores), with the
2-rank runs of "another number of ranks" below (``R``, ``RT`` in the first, ``W2`` in the second):

1. ``A`` trains 8 steps straight; ``B`` the same with a checkpoint every 4 steps (``BA``: the same
   with ``checkpoint.async``); ``K`` saves every
   step and is killed (``os._exit``) in the middle of saving step 4.
   ``E`` trains 4 steps with a checkpoint every 2. Every other family (``A-qwen3_vl``, ...) trains
   4 steps straight and stops after 2 (``B-<family>``).
2. in fresh processes: ``C`` resumes ``B`` from step 4 (its step-8 checkpoint removed, as if the
   job had stopped there); ``D`` the same without the optimizer state; ``L`` the same with
   another ``train.lr``; ``K2`` resumes ``K``; ``X`` tries a copy of ``B`` whose metadata is
   corrupt; ``E2`` and ``E3`` resume copies of ``E`` from step 2, behind its step 4 (refused;
   then asked for with ``train.resume_older``); ``C-<family>`` resumes ``B-<family>`` from step 2.

Every optimizer records the LR each step applies and its Adam step count (a step pre-hook).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist
from conftest import FAMILIES, make_batch, record_applied, tiny_checkpoint
from multiproc import check_ranks, run_ranks
from transformers import Qwen2_5_VLForConditionalGeneration

from qwenkit import cli, data, launch
from qwenkit import config as qconfig
from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.checkpoints import export as hf_export
from qwenkit.engine.checkpoints import resume
from qwenkit.engine.run import metrics, optim, train
from qwenkit.model.families import registry as families

BASE = [
    "train.steps=8",
    "train.micro_batch_size=2",
    "train.warmup_steps=2",
    "data.tiny_samples=16",  # 4 global batches per epoch: 8 steps cross an epoch boundary
    "checkpoint.save_final=true",
]
NEW_LR = 5e-4  # L resumes B with another train.lr
E_RUN = ["train.steps=4", "checkpoint.every=2", "checkpoint.keep_last=1"]
# every other family's tiny model, sharded by its own units: A-<family> straight, B-<family> stops, C-<family> resumes
OTHER_FAMILIES = {
    name: [f"model.name={name}", f"parallel.shard_patterns=[{', '.join(families.get(name).shard_units)}]", "train.steps=4"]
    for name in FAMILIES
    if name != "qwen2_5_vl"
}


def _schedule(lr, steps, total=8):
    """The LR config-driven steps should apply: train.lr * lr_factor with BASE's warmup and floor."""
    defaults = qconfig.TrainConfig()
    return [lr * optim.lr_factor(s, 2, total, defaults.min_lr_ratio) for s in steps]


def _recording_builder(path):
    """qwenkit.data.build, plus a file of the input_ids of every batch handed to the trainer."""

    def build(cfg, processor, rank, world_size):
        bundle = data.build(cfg, processor, rank, world_size)
        batches = bundle.batches

        def recorded():
            for batch in batches():
                with open(path / f"batches-rank{rank}.jsonl", "a") as f:
                    f.write(json.dumps(batch["input_ids"].tolist()) + "\n")
                yield batch

        bundle.batches = recorded
        return bundle

    return build


def _record_applied_lr(build):
    """optim.build_optimizer whose optimizer notes, before each step, the LR and Adam steps it has."""

    def wrapped(model, train_cfg):
        opt = build(model, train_cfg)
        opt.applied = record_applied(opt)
        return opt

    return wrapped


def _run(out, name, overrides, rank):
    run_dir = out / name
    run_dir.mkdir(exist_ok=True)
    cfg = qconfig.load(overrides=BASE + overrides + [f"train.output_dir={run_dir}"])
    trainer = train.Trainer(cfg, _recording_builder(run_dir))
    try:
        trainer.run()
    except ckpt.CheckpointError as e:
        (run_dir / f"error-rank{rank}.txt").write_text(str(e))
    if rank == 0:
        applied = trainer.optimizer.applied if trainer.optimizer is not None else []
        (run_dir / "result.json").write_text(
            json.dumps({
                "start": trainer.start_step, "losses": [h["loss"] for h in trainer.history],
                "logged_lr": [h["lr"] for h in trainer.history], "applied": applied,
            })
        )  # fmt: skip
    return trainer


class _SlowStaging(ckpt.AsyncSaves):
    """Copies to CPU that outlast step 3's forward and backward: a trainer that let that step's
    optimizer update the weights before the copy ended would save step 3's weights as step 2's."""

    def __init__(self, device):
        super().__init__(device)
        stage = self.stager._stage

        def slow(state_dict, **kwargs):
            time.sleep(1.0)
            return stage(state_dict, **kwargs)

        self.stager._stage = slow


def _first_launch(rank, out):
    dist.init_process_group("gloo")
    optim.build_optimizer = _record_applied_lr(optim.build_optimizer)
    _run(out, "A", ["checkpoint.save_final=false"], rank)
    _run(out, "B", ["train.stop_after=4"], rank)  # stops after step 4 (its final checkpoint), schedule of 8
    real_saves = ckpt.AsyncSaves
    ckpt.AsyncSaves = _SlowStaging
    _run(out, "BA", ["train.stop_after=4", "checkpoint.async=true", "checkpoint.every=2"], rank)  # B, async
    ckpt.AsyncSaves = real_saves
    _run(out, "E", ["train.steps=4", "checkpoint.every=2"], rank)
    for name, overrides in OTHER_FAMILIES.items():
        _run(out, f"A-{name}", [*overrides, "checkpoint.save_final=false"], rank)
        _run(out, f"B-{name}", [*overrides, "train.stop_after=2"], rank)
    _reshape_runs(rank, out, FIRST_RESHAPE_RUNS)  # before K: K's save ends the launch
    real_write = ckpt._write

    def dying_write(path, obj):  # step 4's DCP shards are on disk, its rank files are not
        if path.parent.name == ".tmp-step-00000004":
            os._exit(17)
        real_write(path, obj)

    ckpt._write = dying_write
    _run(out, "K", ["train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=2"], rank)


def _second_launch(rank, out, processor_path):
    from qwenkit.model.processor import Processor

    dist.init_process_group("gloo")
    optim.build_optimizer = _record_applied_lr(optim.build_optimizer)
    trainer = _run(out, "C", [], rank)
    model = trainer.model
    model.configure_loss(chunk=False)
    model.eval()
    batch = make_batch(Processor.from_pretrained(processor_path), seed=5)
    batch.pop("labels")
    with torch.no_grad():
        logits = model(**batch).logits
    if rank == 0:
        torch.save({"batch": batch, "logits": logits}, out / "C" / "logits.pt")
    _run(out, "D", ["checkpoint.load_optimizer=false"], rank)
    _run(out, "L", [f"train.lr={NEW_LR}"], rank)
    behind = [f"train.resume={out / 'E2' / 'checkpoints' / 'step-00000002'}", *E_RUN]
    _run(out, "E2", behind, rank)
    behind = [f"train.resume={out / 'E3' / 'checkpoints' / 'step-00000002'}", *E_RUN, "train.resume_older=true"]
    e3 = _run(out, "E3", behind, rank)
    try:  # E3's step 4 again: a save never replaces a complete checkpoint
        ckpt.save(ckpt.checkpoint_root(out / "E3"), 4, e3.model, e3.optimizer, e3.bundle.sampler,
                  torch.device("cpu"), keep_last=1)  # fmt: skip
    except ckpt.CheckpointError as e:
        (out / "E3" / f"replace-rank{rank}.txt").write_text(str(e))
    _run(out, "K2", ["train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=2"], rank)
    _run(out, "X", [], rank)
    for name, overrides in OTHER_FAMILIES.items():
        _run(out, f"C-{name}", overrides, rank)
    _reshape_runs(rank, out, [("W2", [])])
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def out(tmp_path_factory, tiny_path):
    """Both 2-rank launches, and between them the 1-rank one of "another number of ranks"."""
    out = tmp_path_factory.mktemp("ckpt")
    for name in OTHER_FAMILIES:
        tiny_checkpoint(name)  # written here, the ranks only read it
    codes = run_ranks(_first_launch, 2, out)
    assert codes == [17, 17], f"first launch: exit codes {codes}, expected both ranks killed in K's save"
    for copy in ("C", "D", "L", "X"):
        shutil.copytree(out / "B" / "checkpoints", out / copy / "checkpoints")
    for name in OTHER_FAMILIES:
        shutil.copytree(out / f"B-{name}" / "checkpoints", out / f"C-{name}" / "checkpoints")
    for copy in ("E2", "E3"):
        shutil.copytree(out / "E" / "checkpoints", out / copy / "checkpoints")
    (out / "X" / "checkpoints" / "step-00000004" / ".metadata").write_bytes(b"not a DCP metadata file")
    shutil.copytree(out / "K" / "checkpoints", out / "K2" / "checkpoints")
    os.rename(out / "K" / "metrics", out / "K2" / "metrics-killed")
    for source, dest in (("R", "W1"), ("R", "W4"), ("RT", "WT")):
        _copy_checkpoint(out, source, 4, dest)
    check_ranks(_reshape_launch, 1, out, [("W1", ["train.grad_accum=2", "checkpoint.every=2"]),
                                          ("WT", [*BUDGET, "train.grad_accum=2"])])  # fmt: skip
    _copy_checkpoint(out, "W1", 6, "W2")
    check_ranks(_second_launch, 2, out, tiny_path)
    return out


def _result(out, name):
    return json.loads((out / name / "result.json").read_text())


def _batches(out, name, rank):
    return (out / name / f"batches-rank{rank}.jsonl").read_text().splitlines()


@pytest.mark.slow
def test_resume_is_bit_identical_and_continues_the_data(out):
    a, b, c = _result(out, "A"), _result(out, "B"), _result(out, "C")
    assert a["start"] == 0 and len(a["losses"]) == 8
    assert b["losses"] == a["losses"][:4]  # stopping early changes nothing before the stop
    assert [p.name for p in (out / "B" / "checkpoints").iterdir()] == ["step-00000004"]
    assert c["start"] == 4
    assert c["losses"] == a["losses"][4:]  # exact float equality, not a tolerance
    for rank in (0, 1):
        assert _batches(out, "C", rank) == _batches(out, "A", rank)[4:]
    assert _batches(out, "A", 0) != _batches(out, "A", 1)  # the ranks saw different samples


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OTHER_FAMILIES))
def test_every_family_resumes_bit_identical(out, name):
    a, b, c = _result(out, f"A-{name}"), _result(out, f"B-{name}"), _result(out, f"C-{name}")
    assert len(a["losses"]) == 4 and b["losses"] == a["losses"][:2]
    assert c["start"] == 2
    assert c["losses"] == a["losses"][2:]  # exact float equality, not a tolerance
    for rank in (0, 1):
        assert _batches(out, f"C-{name}", rank) == _batches(out, f"A-{name}", rank)[2:]


def _dcp_tensors(path, tmp_path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, by its flattened key (read in this process, no group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(tmp_path / "state.pt"))

    def flat(d, prefix=""):
        for k, v in d.items():
            yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(prefix + str(k), v)]

    return {k: v for k, v in flat(torch.load(tmp_path / "state.pt", weights_only=False)) if isinstance(v, torch.Tensor)}


@pytest.mark.slow
def test_async_checkpoints_equal_synchronous_ones_bit_for_bit(out, tmp_path):
    """BA is B with checkpoint.async (and a background save at step 2 while steps 3 and 4 train)."""
    assert _result(out, "BA")["losses"] == _result(out, "B")["losses"]
    root = out / "BA" / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000002", "step-00000004"]
    from torch.distributed.checkpoint import FileSystemReader

    # step 4, the final save, against B's: every file's size and CRC-32; DCP's .metadata names its own
    # directory, so it (and the manifests that list its CRC) differ by that path alone: its tensors'
    # entries are compared instead
    async_dir, sync_dir = root / "step-00000004", out / "B" / "checkpoints" / "step-00000004"
    async_files, sync_files = (ckpt.read_marker(d)["files"] for d in (async_dir, sync_dir))
    differ = sorted(n for n in sync_files if async_files.get(n) != sync_files[n])
    assert differ == [".metadata", "manifest-rank-00000.json"], differ
    metadata = [FileSystemReader(str(d)).read_metadata() for d in (async_dir, sync_dir)]
    assert metadata[0].state_dict_metadata == metadata[1].state_dict_metadata
    # step 2 was copied while step 3 trained (the copy slowed down, _SlowStaging): its tensors equal
    # E's synchronous step 2 (the same warmup LR; E's param_groups hold its own next LR, of 4 steps)
    staged, synced = (_dcp_tensors(d / "checkpoints" / "step-00000002", tmp_path) for d in (out / "BA", out / "E"))
    assert staged.keys() == synced.keys() and len(staged) > 100
    assert [k for k in staged if not torch.equal(staged[k], synced[k])] == []
    assert not list(root.glob(".tmp-*"))


@pytest.mark.slow
def test_resume_without_optimizer_state(out):
    c, d = _result(out, "C"), _result(out, "D")
    assert d["start"] == 4
    assert d["losses"][0] == c["losses"][0]  # same weights and batch
    # the optimizer after the load: C's AdamW has taken 4 steps, D's is fresh (no moments, step 0)
    assert [a["adam_steps"] for a in c["applied"]] == [4.0, 5.0, 6.0, 7.0]
    assert [a["adam_steps"] for a in d["applied"]] == [0.0, 1.0, 2.0, 3.0]
    assert d["losses"][1] != c["losses"][1]  # a fresh AdamW takes another step


@pytest.mark.slow
@pytest.mark.parametrize("name, lr", [("C", None), ("D", None), ("L", NEW_LR)])
def test_lr_applied_after_resume_is_the_lr_logged(out, name, lr):
    """The resume follows the running config's schedule at its step; the LR used is the LR logged."""
    got = _result(out, name)
    want = _schedule(lr or qconfig.TrainConfig().lr, range(5, 9))
    applied = [a["lr"] for a in got["applied"]]
    assert applied == pytest.approx(want, rel=1e-12)
    assert got["logged_lr"] == applied


@pytest.mark.slow
def test_resume_behind_a_newer_checkpoint_is_refused_and_nothing_changes(out):
    e = _result(out, "E")
    root = out / "E2" / "checkpoints"
    for rank in (0, 1):
        message = (out / "E2" / f"error-rank{rank}.txt").read_text()
        assert "step-00000004" in message and "train.resume_older" in message
    assert _result(out, "E2")["losses"] == []
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000002", "step-00000004"]
    original = out / "E" / "checkpoints" / "step-00000004" / ckpt.COMPLETE
    assert (root / "step-00000004" / ckpt.COMPLETE).read_text() == original.read_text()
    assert len(e["losses"]) == 4


@pytest.mark.slow
def test_resume_older_sets_the_newer_checkpoint_aside_and_keeps_what_it_writes(out):
    e, e3 = _result(out, "E"), _result(out, "E3")
    root = out / "E3" / "checkpoints"
    assert e3["start"] == 2 and e3["losses"] == e["losses"][2:]
    # keep_last=1: the new step 4 pruned step 2 and stays; the old step 4 was moved, not deleted
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000004"]
    (aside,) = root.glob("superseded-*")
    original = out / "E" / "checkpoints" / "step-00000004" / ckpt.COMPLETE
    assert (aside / "step-00000004" / ckpt.COMPLETE).read_text() == original.read_text()
    assert (root / "step-00000004" / ckpt.COMPLETE).read_text() != original.read_text()
    assert ckpt.latest(root) == root / "step-00000004"
    for rank in (0, 1):  # saving step 4 once more is refused, the checkpoint stays
        assert "exists already" in (out / "E3" / f"replace-rank{rank}.txt").read_text()
    assert ckpt.latest(root) == root / "step-00000004"


@pytest.mark.slow
def test_killed_save_leaves_the_previous_checkpoint_selected(out):
    # what the killed job left (copied to K2 before K2 ran): steps 2 and 3 complete, 4 half-written
    assert (out / "K" / "checkpoints" / ".tmp-step-00000004").is_dir()
    assert [p.name for p in ckpt.complete_checkpoints(out / "K" / "checkpoints")] == ["step-00000002", "step-00000003"]
    assert ckpt.latest(out / "K" / "checkpoints").name == "step-00000003"
    k2 = _result(out, "K2")
    assert k2["start"] == 3
    killed = metrics.series(metrics.read(out / "K2" / "metrics-killed" / "rank-00000.jsonl"), "loss")
    assert k2["losses"] == [killed[4]]  # step 4 again, from the checkpoint, bit for bit
    # K2's own save of step 4 completed, pruned step 2 (keep_last=2) and removed the stale temp dir
    root = out / "K2" / "checkpoints"
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000003", "step-00000004"]
    assert not list(root.glob(".tmp-*"))


@pytest.mark.slow
def test_corrupt_checkpoint_is_named(out):
    for rank in (0, 1):
        message = (out / "X" / f"error-rank{rank}.txt").read_text()
        assert str(out / "X" / "checkpoints" / "step-00000004") in message


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_same_logits(out, tmp_path):
    saved = torch.load(out / "C" / "logits.pt")
    cfg = qconfig.load(ckpt.run_config_path(out / "C"))
    assert cfg.train.output_dir == str(out / "C")
    exported = hf_export.export(out / "C", tmp_path / "hf", cfg)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert (exported / name).is_file(), name
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(exported).eval()
    with torch.no_grad():
        logits = model(**saved["batch"]).logits
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Another number of ranks (issue 32): R trains 8 steps on 2 ranks (2 epochs of 4 steps, 4 samples
# a step), saving at step 4. Its step 4 resumes on 1 rank with twice the accumulation (W1, which
# saves at step 6) and on 4 ranks with half the micro-batch (W4); W1's step 6 resumes on 2 ranks
# (W2). The global batch is kept in each, so each step takes R's samples. RT/WT: the same, 2 ranks
# -> 1 rank x 2, under a packed token budget. Each rank records the sample indices it took.
# R, RT and W2 run in the 2-rank launches of ``out`` above, W1 and WT between them.

RESHAPE = ["train.steps=8", "train.warmup_steps=2", "data.tiny_samples=16", "data.tiny_eval_samples=0",
           "train.eval_samples=0", "train.micro_batch_size=2"]  # fmt: skip
BUDGET = ["data.packing=true", "data.max_tokens_per_batch=160", "data.max_length=160"]


def _sample_recorder(path, rank):
    """qwenkit.data.build whose batches() also append each micro-batch's sample indices to a file."""

    def build(cfg, processor, rank_, world_size):
        bundle = data.build(cfg, processor, rank_, world_size)

        def recorded():  # DataBundle.batches with num_workers=0, noting the indices
            for indices in bundle.sampler:
                with open(path / f"samples-rank{rank}.jsonl", "a") as f:
                    f.write(json.dumps(indices) + "\n")
                yield bundle.collator([bundle.dataset[i] for i in indices])

        bundle.batches = recorded
        return bundle

    return build


FIRST_RESHAPE_RUNS = [("R", ["checkpoint.every=4"]), ("RT", [*BUDGET, "checkpoint.every=4"])]


def _reshape_launch(rank, out, runs):
    dist.init_process_group("gloo")
    _reshape_runs(rank, out, runs)
    dist.destroy_process_group()


def _reshape_runs(rank, out, runs):
    for name, overrides in runs:
        run_dir = out / name
        run_dir.mkdir(exist_ok=True)
        handler = logging.FileHandler(run_dir / f"log-rank{rank}.txt")
        logging.getLogger("qwenkit").addHandler(handler)
        logging.getLogger("qwenkit").setLevel(logging.INFO)
        cfg = qconfig.load(overrides=[*RESHAPE, *overrides, f"train.output_dir={run_dir}"])
        trainer = train.Trainer(cfg, _sample_recorder(run_dir, rank))
        trainer.run()
        logging.getLogger("qwenkit").removeHandler(handler)
        if rank == 0:
            (run_dir / "result.json").write_text(json.dumps({
                "start": trainer.start_step, "losses": [h["loss"] for h in trainer.history],
                "lr": [h["lr"] for h in trainer.history], "world": dist.get_world_size(),
                "accum": cfg.train.grad_accum,
            }))  # fmt: skip


def _copy_checkpoint(out, source, step, dest):
    name = f"step-{step:08d}"
    shutil.copytree(out / source / "checkpoints" / name, out / dest / "checkpoints" / name)


@pytest.fixture(scope="module")
def reshaped(out):
    check_ranks(_reshape_launch, 4, out, [("W4", ["train.micro_batch_size=1"])])
    return out


def _steps_taken(out, name):
    """``{step: sorted sample indices of every rank's micro-batches of that step}`` of one invocation."""
    result = _result(out, name)
    per_rank = [[json.loads(line) for line in (out / name / f"samples-rank{r}.jsonl").read_text().splitlines()]
                for r in range(result["world"])]  # fmt: skip
    a = result["accum"]
    return {result["start"] + 1 + j: sorted(i for rank in per_rank for b in rank[j * a : (j + 1) * a] for i in b)
            for j in range(len(result["losses"]))}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name, reference, start, saved_by",
                         [("W1", "R", 4, 2), ("W4", "R", 4, 2), ("W2", "R", 6, 1), ("WT", "RT", 4, 2)])  # fmt: skip
def test_resume_on_other_ranks_takes_the_same_steps(reshaped, name, reference, start, saved_by):
    ref, got = _result(reshaped, reference), _result(reshaped, name)
    assert got["start"] == start and len(got["losses"]) == 8 - start
    ref_steps, steps = _steps_taken(reshaped, reference), _steps_taken(reshaped, name)
    assert steps == {s: ref_steps[s] for s in steps}  # the same samples in each step
    assert got["lr"] == pytest.approx(ref["lr"][start:], rel=1e-12)  # the LR schedule goes on from its step
    # fp32 (eps 1.2e-7): the same sums in another order (another all-reduce tree, micro-batches
    # summed on one rank) and over 4 AdamW steps: a few ulps of the loss, not more
    torch.testing.assert_close(got["losses"], ref["losses"][start:], rtol=1e-6, atol=0)
    log_text = (reshaped / name / "log-rank0.txt").read_text()
    assert f"world_size {saved_by} -> {got['world']}" in log_text and "RNG re-seeded per rank" in log_text
    if name != "WT":  # a token budget keeps the micro-batches per step, not a number of samples
        assert "global batch 4 samples kept" in log_text


@pytest.mark.slow
def test_an_epoch_resumed_on_other_ranks_sees_every_sample_once(reshaped):
    """Epoch 1 is steps 5-8: W1 took steps 5-6 on 1 rank, W2 steps 7-8 on 2; W4 steps 5-8 on 4."""
    w1, w2, w4 = (_steps_taken(reshaped, n) for n in ("W1", "W2", "W4"))
    for epoch in ([w1[5], w1[6], w2[7], w2[8]], [w4[s] for s in (5, 6, 7, 8)]):
        assert sorted(i for step in epoch for i in step) == list(range(16))


# ---------------------------------------------------------------------------------------------
# No process group needed


def _cfg(output_dir, resume, *overrides):
    return qconfig.load(overrides=[f"train.output_dir={output_dir}", f"train.resume={resume}", *overrides])


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path):
    assert resume.decide(_cfg(tmp_path, "auto"), 2).path is None
    assert resume.decide(_cfg(tmp_path, "none"), 2).path is None
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        resume.decide(_cfg(tmp_path, tmp_path / "nope"), 2)


def _fake_checkpoints(output_dir, steps):
    root = ckpt.checkpoint_root(output_dir)
    for step in steps:
        ckpt.step_dir(root, step).mkdir(parents=True)
        (ckpt.step_dir(root, step) / ckpt.COMPLETE).write_text(json.dumps({"step": step}))
    return root


@pytest.mark.parametrize(
    "resume, refused", [("step-00000002", True), ("none", True), ("auto", False), ("step-00000004", False)]
)
def test_launcher_refuses_a_resume_behind_newer_checkpoints(tmp_path, monkeypatch, capsys, resume, refused):
    spawned = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: spawned.append(a) or 0)
    root = _fake_checkpoints(tmp_path, [2, 4])
    target = resume if resume in ("none", "auto") else str(root / resume)
    args = ["train", f"train.output_dir={tmp_path}", f"train.resume={target}"]
    assert cli.main(args) == (2 if refused else 0)
    assert bool(spawned) is not refused
    if refused:
        assert "step-00000004" in capsys.readouterr().err
        assert cli.main([*args, "train.resume_older=true"]) == 0  # asked for explicitly: starts
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step-00000002", "step-00000004"]


def _recorded_checkpoint(output_dir, step, *overrides, world_size=2):
    """A checkpoint folder whose COMPLETE.json records the run that saved it (no state files)."""
    root = ckpt.checkpoint_root(output_dir)
    ckpt.step_dir(root, step).mkdir(parents=True)
    run = resume.run_record(qconfig.load(overrides=list(overrides)), world_size)
    marker = {"step": step, "world_size": world_size, "run": run}
    (ckpt.step_dir(root, step) / ckpt.COMPLETE).write_text(json.dumps(marker))
    return ckpt.step_dir(root, step)


BUDGET_ONE = [*BUDGET, "parallel.allow_oversubscribe=true"]


@pytest.mark.parametrize("saved, start, nproc, refusal", [
    (["train.seed=1"], ["train.seed=2"], 2, "train.seed saved 1, now 2: set train.seed=1 to continue that run"),
    (["data.shuffle=false"], [], 2, "data.shuffle saved False, now True: set data.shuffle=false"),
    (BUDGET, [*BUDGET, "data.packing=false"], 2, "data.packing saved True, now False"),
    (BUDGET, BUDGET_ONE, 1, "2 per step (2 data-parallel ranks x train.grad_accum=1), this run takes 1 "
                            "(1 x train.grad_accum=1): set train.grad_accum=2"),
    (BUDGET, [*BUDGET_ONE, "train.grad_accum=2"], 1, None),
    ([], ["train.micro_batch_size=4"], 1, None),  # fixed size: any shape, the position is global
    (["data.packing=true"], [], 2, None),  # packing a fixed-size batch does not change its samples
])  # fmt: skip
def test_the_launcher_refuses_another_data_order_before_spawning(tmp_path, monkeypatch, capsys, saved, start, nproc,
                                                                  refusal):  # fmt: skip
    spawned = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: spawned.append(a) or 0)
    if refusal:
        monkeypatch.setattr(qconfig, "write_config", lambda *a: pytest.fail("a refused start rewrote config.yaml"))
    checkpoint = _recorded_checkpoint(tmp_path, 4, *saved)
    code = cli.main(["train", "--nproc", str(nproc), f"train.output_dir={tmp_path}", *start])
    err = capsys.readouterr().err
    if refusal is None:
        assert code == 0 and spawned, err
        return
    assert code == 2 and not spawned
    (line,) = [x for x in err.splitlines() if "cannot resume" in x]
    assert refusal in line and str(checkpoint) in line, line


def test_the_launcher_refuses_a_changed_dataset_before_spawning(tmp_path, monkeypatch, capsys):
    """COMPLETE.json records the data files' sizes: rows added since the save are refused before
    spawn, naming the file; the same files moved elsewhere resume."""
    spawned = []
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: spawned.append(a) or 0)
    rows = tmp_path / "data" / "part" / "rows.jsonl"
    rows.parent.mkdir(parents=True)
    row = '{"messages": [{"role": "user", "content": "Hi %d"}, {"role": "assistant", "content": "Hello."}]}\n'
    rows.write_text("".join(row % i for i in range(8)))
    checkpoint = _recorded_checkpoint(tmp_path / "run", 4, f"data.path={tmp_path / 'data'}")
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "data", moved)
    start = ["train", "--nproc", "2", f"train.output_dir={tmp_path / 'run'}"]
    assert cli.main([*start, f"data.path={moved}"]) == 0 and spawned, capsys.readouterr().err
    spawned.clear()
    saved_size = rows.stat().st_size
    with open(rows, "a") as f:
        f.write(row % 8)
    monkeypatch.setattr(qconfig, "write_config", lambda *a: pytest.fail("a refused start rewrote config.yaml"))
    assert cli.main([*start, f"data.path={tmp_path / 'data'}"]) == 2 and not spawned
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "cannot resume" in x]
    assert str(checkpoint) in line and "another train.output_dir" in line, line
    assert f"data file 'part/rows.jsonl' had {saved_size} bytes, now {rows.stat().st_size}" in line, line
