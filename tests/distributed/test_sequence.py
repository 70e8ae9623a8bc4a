"""Ulysses sequence parallelism: 2 (and 4) gloo ranks against one process on the same batch.

Each case builds the same tiny model (random weights) on every rank, computes the one-process
reference (the subclass's own chunked forward, itself tested against HF's), then runs the batch
split over an SP group: the group's losses must sum to the reference loss and the ranks'
gradients (summed, as FSDP's reduction does) must equal every reference gradient.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import build_model, make_batch, tiny_checkpoint
from data.test_packing import samples_of
from model.families.test_chunked import _video_batch
from multiproc import check_ranks, free_port

from qwenkit import config as qconfig
from qwenkit.data.collator import Collator
from qwenkit.distributed import fsdp, sequence
from qwenkit.engine.run import events, metrics
from qwenkit.model.families import registry as families

FP32 = dict(rtol=1e-5, atol=1e-5)  # the bound; fp32, sums over ranks in another order


def _odd(batch, processor):
    """Pad the batch by one column when its length is even: S not divisible by the SP size."""
    if batch["input_ids"].shape[1] % 2:
        return batch
    out = dict(batch)
    for key, value in (("input_ids", processor.pad_token_id), ("attention_mask", 0), ("labels", -100),
                       ("mm_token_type_ids", 0)):  # fmt: skip
        out[key] = torch.nn.functional.pad(batch[key], (0, 1), value=value)
    return out


def cases(processor, family="qwen2_5_vl") -> dict[str, dict]:
    text = _odd(make_batch(processor, images_per_sample=(0, 0, 0), seed=3), processor)
    image = _odd(
        make_batch(processor, images_per_sample=(1, 0, 2), seed=10), processor
    )  # seed 10: an image crosses the middle
    video = _video_batch(processor, family)
    video = {k: v for k, v in video.items()}
    packed = Collator(processor, packing=True)(
        samples_of(processor, make_batch(processor, (1, 0, 2, 1), seed=5))
    )
    packed.pop("num_items"), packed.pop("num_samples")
    # one image: the rank without a share runs the tower on a blank patch (the idle-tower rule)
    single = _odd(make_batch(processor, images_per_sample=(0, 1), seed=2), processor)
    return {"text": text, "image": image, "video": video, "packed": packed, "single_image": single,
            "image_video": _image_and_video(processor, family), "image_deepstack_shifted": image,
            "image_linear_on_slice": image}  # fmt: skip


def _image_and_video(processor, family="qwen2_5_vl") -> dict:
    """Two right-padded rows, one with an image, one with a video: two tower calls per rank."""
    image, video = make_batch(processor, images_per_sample=(1,), seed=4), _video_batch(processor, family, seed=1)
    width = max(image["input_ids"].shape[1], video["input_ids"].shape[1])
    width += 1 - width % 2  # odd
    pads = {"input_ids": processor.pad_token_id, "attention_mask": 0, "labels": -100, "mm_token_type_ids": 0}
    batch = {
        key: torch.cat(
            [torch.nn.functional.pad(b[key], (0, width - b[key].shape[1]), value=v) for b in (image, video)]
        )
        for key, v in pads.items()
    }
    batch["mm_token_type_ids"] = batch["mm_token_type_ids"].int()
    for key in ("pixel_values", "image_grid_thw"):
        batch[key] = image[key]
    for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        if key in video:
            batch[key] = video[key]
    return batch


def straddles(batch, token_id: int, n: int) -> bool:
    """Some placeholder run crosses a slice boundary of the padded sequence."""
    s = batch["input_ids"].shape[1]
    width = (s + (-s) % n) // n
    is_token = batch["input_ids"] == token_id
    return any(bool((is_token[:, k * width - 1] & is_token[:, k * width]).any()) for k in range(1, n))


def _loss_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()
    }


def _count_vision_rows(model) -> list[int]:
    """Patch rows this rank's vision tower encodes (the blank patch of an idle call counts 0)."""
    rows, tower = [], model.vision_tower

    def counting(pixels, grid_thw):
        rows.append(int(pixels.shape[0]) if bool(pixels.abs().sum() > 0) else 0)
        return tower(pixels, grid_thw)

    model.vision_tower = counting
    return rows


def _shift_deepstack(monkeypatch_target):
    """Mutation: DeepStack's features added one position to the right of the visual positions (what
    the equality must catch). Returns the function that undoes it."""
    real = monkeypatch_target._deepstack_inputs

    def shifted(model, visual):
        out = real(model, visual)
        if "visual_pos_masks" in out:
            out["visual_pos_masks"] = out["visual_pos_masks"].roll(1, dims=1)
        return out

    monkeypatch_target._deepstack_inputs = shifted
    return lambda: setattr(monkeypatch_target, "_deepstack_inputs", real)


def _linear_attention_on_the_slice():
    """Mutation: Qwen3.5's linear-attention layers run on this rank's slice (the trap: the conv window
    and the state start at the slice). Returns the function that undoes it."""
    import importlib

    from qwenkit.model.families import linear_attention as la

    module = importlib.import_module(la.MODULES[0])
    real = {fn: getattr(module, fn) for fn in (la.CONV, la.DELTA)}
    for fn, f in real.items():
        setattr(module, fn, lambda *a, sequence_parallel=None, _f=f, **k: _f(*a, **k))
    return lambda: [setattr(module, fn, f) for fn, f in real.items()]


def _equality_ranks(rank, out, plan, sp_size=2):
    """``plan``: {family: [case names]}, each case of each family against its one-process reference."""
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    sp = sequence.init_groups(rank, world, sp_size)
    results = {family: _equalities(sp, family, names, sp_size) for family, names in plan.items()}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _equalities(sp, family, names, sp_size):
    from conftest import tiny_processor

    from qwenkit.model import parallel

    processor = tiny_processor(family)
    base = build_model(chunk=True, seed=1, name=family)
    results = {}
    for name, batch in cases(processor, family).items():
        if name not in names:
            continue
        ref = copy.deepcopy(base)
        ref_loss, ref_grads = _loss_grads(ref, batch)
        model = copy.deepcopy(base)
        sequence.enable(model, sp)
        vision_rows = _count_vision_rows(model)
        undo = _shift_deepstack(parallel) if name == "image_deepstack_shifted" else (lambda: None)
        if name == "image_linear_on_slice":
            undo = _linear_attention_on_the_slice()
        loss, grads = _loss_grads(model, batch)
        undo()
        total = loss.clone()
        dist.all_reduce(total, group=sp.group)  # the group's slices sum to the whole loss
        worst, mismatches = 0.0, []
        for key, ref_grad in ref_grads.items():
            g = grads[key] if grads[key] is not None else torch.zeros_like(ref.get_parameter(key))
            g = g.clone()
            dist.all_reduce(g, group=sp.group)  # FSDP's reduction sums (averages) the ranks' gradients
            if ref_grad is None:
                ref_grad = torch.zeros_like(g)
            if not torch.allclose(g, ref_grad, **FP32):
                mismatches.append(key)
            worst = max(worst, float((g - ref_grad).abs().max()))
        pixels = batch.get("pixel_values", batch.get("pixel_values_videos"))
        results[name] = {
            "mismatched_grads": mismatches,
            "loss": float(total), "ref_loss": float(ref_loss), "worst_grad_diff": worst,
            "vision_rows": sum(vision_rows), "total_rows": 0 if pixels is None else pixels.shape[0],
            "straddles": straddles(batch, processor.image_token_id, sp_size)
            or straddles(batch, processor.video_token_id, sp_size),
        }  # fmt: skip
    return results


@pytest.fixture(scope="module")
def equalities(tmp_path_factory, tiny_path):
    """Both families in one 2-rank run (one start of the ranks); Qwen3-VL: DeepStack features on the
    visual positions of each slice."""
    out = tmp_path_factory.mktemp("sp_equal")
    tiny_checkpoint("qwen3_vl")  # written here, the ranks only read it
    plan = {"qwen2_5_vl": ["text", "image", "video", "packed", "single_image", "image_video"],
            "qwen3_vl": ["image", "video", "packed", "image_video", "image_deepstack_shifted"]}  # fmt: skip
    if not families.get("qwen3_5").unavailable():  # Qwen3.5: linear attention on whole sequences per head
        tiny_checkpoint("qwen3_5")
        plan["qwen3_5"] = ["text", "image", "video", "packed", "image_video", "image_linear_on_slice"]
    check_ranks(_equality_ranks, 2, out, plan, timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def equality(equalities):
    return [rank["qwen2_5_vl"] for rank in equalities]


@pytest.fixture(scope="module")
def equality_qwen3(equalities):
    return [rank["qwen3_vl"] for rank in equalities]


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("name", ["image", "video", "packed", "image_video"])
def test_qwen3_vl_two_ranks_equal_one_process(equality_qwen3, name):
    r0, r1 = equality_qwen3[0][name], equality_qwen3[1][name]
    assert r0["loss"] == pytest.approx(r0["ref_loss"], rel=1e-5, abs=1e-5)
    assert not r0["mismatched_grads"] and not r1["mismatched_grads"], r0["mismatched_grads"]
    if name != "image_video":  # (two modalities: total_rows counts the images only)
        rows = [equality_qwen3[r][name]["vision_rows"] for r in range(2)]
        assert sum(rows) == r0["total_rows"] and all(0 < n < r0["total_rows"] for n in rows), rows


@pytest.mark.slow
@pytest.mark.stack
def test_qwen3_vl_deepstack_one_position_off_is_caught(equality_qwen3):
    """The equality above is sensitive to where DeepStack's features land: one position off fails it."""
    shifted = equality_qwen3[0]["image_deepstack_shifted"]
    assert len(shifted["mismatched_grads"]) > 10 and shifted["worst_grad_diff"] > 1e-3, shifted


@pytest.fixture(scope="module")
def equality_qwen3_5(equalities):
    if "qwen3_5" not in equalities[0]:
        pytest.skip("transformers 4.57 has no Qwen3.5")
    return [rank["qwen3_5"] for rank in equalities]


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("name", ["text", "image", "video", "packed", "image_video"])
def test_qwen3_5_two_ranks_equal_one_process(equality_qwen3_5, name):
    """The Gated DeltaNet layers exchange heads for the sequence (conv and recurrence on whole
    sequences), the attention layer as Ulysses does; a packed row restarts them at every sample."""
    r0, r1 = equality_qwen3_5[0][name], equality_qwen3_5[1][name]
    assert r0["loss"] == pytest.approx(r0["ref_loss"], rel=1e-5, abs=1e-5)
    assert not r0["mismatched_grads"] and not r1["mismatched_grads"], (r0["mismatched_grads"], r0["worst_grad_diff"])


@pytest.mark.slow
@pytest.mark.stack
def test_qwen3_5_linear_attention_on_the_slice_is_caught(equality_qwen3_5):
    """Run on each rank's slice (the trap), the linear layers give other losses and gradients."""
    sliced = equality_qwen3_5[0]["image_linear_on_slice"]
    assert len(sliced["mismatched_grads"]) > 10 and sliced["worst_grad_diff"] > 1e-3, sliced


@pytest.fixture(scope="module")
def equality4(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("sp4_equal")
    # Qwen3-VL: 4 query heads of 32 (the tiny Qwen2.5-VL has 2, which 4 ranks cannot split) and 2 KV heads
    check_ranks(_equality_ranks, 4, out, {"qwen3_vl": ["text", "image", "packed"]}, 4, timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text())["qwen3_vl"] for r in range(4)]


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("name", ["text", "image", "video", "packed", "single_image", "image_video"])
def test_two_ranks_equal_one_process(equality, name):
    r0, r1 = equality[0][name], equality[1][name]
    assert r0["loss"] == pytest.approx(r0["ref_loss"], rel=1e-5, abs=1e-5)
    assert not r0["mismatched_grads"] and not r1["mismatched_grads"], r0["mismatched_grads"]
    assert r0["worst_grad_diff"] < 1e-4, r0["worst_grad_diff"]  # also within rtol 1e-5 of each element


@pytest.mark.slow
@pytest.mark.parametrize("name", ["text", "image", "packed"])
def test_four_ranks_sp4_replicate_kv_heads_and_equal_one_process(equality4, name):
    # the tiny Qwen3-VL has 2 KV heads: at sp_size 4 each is replicated for the exchange
    assert not any(r[name]["mismatched_grads"] for r in equality4), equality4[0][name]["mismatched_grads"]
    assert equality4[0][name]["loss"] == pytest.approx(equality4[0][name]["ref_loss"], rel=1e-5, abs=1e-5)


@pytest.mark.slow
@pytest.mark.stack
def test_single_image_leaves_one_rank_idle(equality):
    rows = sorted(equality[r]["single_image"]["vision_rows"] for r in range(2))
    assert rows == [0, equality[0]["single_image"]["total_rows"]]


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("name", ["image", "video"])
def test_a_placeholder_run_straddles_the_slice_boundary(equality, name):
    assert equality[0][name]["straddles"]


@pytest.mark.slow
@pytest.mark.stack
@pytest.mark.parametrize("name", ["image", "video", "packed"])
def test_each_rank_encodes_only_its_share(equality, name):
    rows = [equality[r][name]["vision_rows"] for r in range(2)]
    total = equality[0][name]["total_rows"]
    assert sum(rows) == total and all(0 < n < total for n in rows), rows


def test_partition_is_contiguous_and_balanced():
    assert sequence.partition([4, 4, 4, 4], 2) == [(0, 2), (2, 4)]
    assert sequence.partition([16], 2) == [(0, 1), (1, 1)]  # one unit: the other rank idles
    assert sequence.partition([1, 1, 8], 2) == [(0, 2), (2, 3)]
    bounds = sequence.partition([3, 5, 2, 7, 1, 4], 3)
    assert [b for _, b in bounds][-1] == 6 and all(a <= b for a, b in bounds)


def test_video_units_are_temporal_patches():
    assert sequence.vision_units(torch.tensor([[1, 4, 6], [3, 2, 2]])) == [(1, 4, 6, 24)] + [(1, 2, 2, 4)] * 3


def test_heads_not_divisible_are_refused():
    from types import SimpleNamespace

    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    assert sequence.heads_problem(cfg, 2) is None and sequence.heads_problem(cfg, 4) is None
    problem = sequence.heads_problem(cfg, 3)
    assert "4 query heads" in problem and "2 key/value heads" in problem


# ---------------------------------------------------------------------------------------------
# qwenkit train with parallel.sp_size (tests/test_launch.py style: torchrun, gloo ranks)

ROOT = Path(__file__).resolve().parents[2]
RUN = ["train.steps=4", "data.tiny_samples=32", "data.tiny_eval_samples=6", "train.eval_every=2",
       "train.eval_accuracy_every=4", "train.eval_samples=2", "checkpoint.every=2", "train.resume=auto",
       "parallel.allow_oversubscribe=true"]  # 4 CPU ranks on a 2-core machine: slow, not wrong  # fmt: skip


def _train(out, nproc, *overrides):
    proc = subprocess.run(
        [sys.executable, "-m", "qwenkit.cli", "train", "--config", "params/tiny_cpu.yaml", "--nproc", str(nproc),
         "--master-port", str(free_port()), *RUN, f"train.output_dir={out}", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return _metrics(out)


def _metrics(out):
    rows = metrics.read(out / "metrics" / "rank-00000.jsonl")
    return {m: metrics.series(rows, m) for m in ("loss", "grad_norm", "eval_loss", "valid_tokens")}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, tiny_path):
    tmp = tmp_path_factory.mktemp("sp_cli")
    # DP 2 x SP 2 on 4 ranks, on an HSDP mesh (2 replicas x 2 shards) across the two SP groups where
    # this torch's gloo has one; FSDP sharding over 4 ranks alone is tests/engine/checkpoints/test_dcp.py's W4
    gloo_hsdp = qconfig.load(overrides=["parallel.hsdp_replicas=2", "parallel.backend=gloo"]).parallel
    hsdp = [] if fsdp.hsdp_problem(gloo_hsdp) else ["parallel.hsdp_replicas=2"]
    runs = {
        # the same global batch of 8 samples: 1 process, one SP group of 2, DP 2 x SP 2 (4 samples each)
        "one": _train(tmp / "one", 1),
        "sp2": _train(tmp / "sp2", 2, "parallel.sp_size=2"),
        "dp2_sp2": _train(tmp / "dp2_sp2", 4, "parallel.sp_size=2", "train.micro_batch_size=4", *hsdp),
    }
    # sp2 stopped after step 2 and resumed, in one start of the 2 ranks: the trainer's SP checkpoint and
    # data position (the command line's stop, exit 75 and resume=auto: tests/engine/checkpoints/test_resume.py's stop_after loop)
    check_ranks(_stop_and_resume, 2, tmp / "resumed", timeout=600)
    runs["resumed"] = _metrics(tmp / "resumed")
    runs["resumed"]["resumed_from"] = events.resumed_step(events.read(tmp / "resumed"))
    return runs


def _stop_and_resume(rank, out):
    from qwenkit.engine.run import train

    dist.init_process_group("gloo")
    sp2 = [*RUN, "parallel.nproc=2", "parallel.sp_size=2", f"train.output_dir={out}"]
    train.run(qconfig.load(ROOT / "params" / "tiny_cpu.yaml", [*sp2, "train.stop_after=2"]))
    train.run(qconfig.load(ROOT / "params" / "tiny_cpu.yaml", sp2))  # train.resume=auto: from step 2
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sp2", "dp2_sp2"])
def test_cli_sp_logs_the_one_process_losses(cli_runs, name):
    one, run = cli_runs["one"], cli_runs[name]
    assert sorted(run["loss"]) == [1, 2, 3, 4] and sorted(run["eval_loss"]) == [0, 2, 4]
    assert run["valid_tokens"] == one["valid_tokens"]  # counted once per SP group, not per rank
    for metric in ("loss", "grad_norm", "eval_loss"):
        for step, value in one[metric].items():
            assert run[metric][step] == pytest.approx(value, rel=1e-5, abs=1e-6), (metric, step)


@pytest.mark.slow
def test_sp_resume_is_bit_identical(cli_runs):
    """The resumed run's steps 3 and 4 (in-process ranks) equal those of the ``qwenkit train`` run."""
    assert cli_runs["resumed"]["resumed_from"] == 2
    for metric in ("loss", "grad_norm", "eval_loss"):
        resumed = {s: v for s, v in cli_runs["resumed"][metric].items() if s > 2}
        assert resumed and resumed == {s: v for s, v in cli_runs["sp2"][metric].items() if s > 2}, metric


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (["--nproc", "2", "parallel.sp_size=3"], "parallel.sp_size=3 must divide parallel.nproc=2"),
        # the tiny model has 2 query heads and 1 KV head: 3 ranks cannot split them
        (["--nproc", "3", "parallel.sp_size=3"], "2 query heads and 1 key/value heads"),
        (["--nproc", "2", "parallel.sp_size=2", "loss.chunk=false"], "needs loss.chunk=true"),
        (["--nproc", "2", "parallel.sp_size=2", "loss.loss_type=sample_mean"], "token_mean only"),
    ],
)
def test_cli_refuses_bad_sp_before_start(tmp_path, monkeypatch, capsys, overrides, problem):
    """``qwenkit train``'s own entry point, in this process (a user error is one line on stderr and
    exit 2 in a process of its own: tests/test_launch.py); torchrun is never started."""
    from qwenkit import cli, launch

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun started"))
    code = cli.main(["train", "--config", str(ROOT / "params" / "tiny_cpu.yaml"), *overrides,
                     f"train.output_dir={tmp_path / 'run'}", "parallel.allow_oversubscribe=true"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and problem in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


@pytest.mark.slow
@pytest.mark.parametrize("sp1_ranks", [pytest.param("1", marks=pytest.mark.long), "2"])
def test_benchmark_runs_and_its_variants_agree(tmp_path, sp1_ranks):
    """benchmarks/sequence_parallel.py at the toy size, SP 1 on one rank (the full size's CPU
    setting) and on two: the rows come out, one per rank, and the two variants' losses are equal."""
    from multiproc import scaled

    out = tmp_path / "rows.jsonl"
    proc = subprocess.run(
        [sys.executable, "sequence_parallel.py", "--tiny", "--sp1-ranks", sp1_ranks, "--json", str(out)],
        cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=scaled(600),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["sp_size"], r["rank"]) for r in rows] == [(1, r) for r in range(int(sp1_ranks))] + [(2, 0), (2, 1)]
    assert len({r["loss"] for r in rows}) == 1 and "losses equal: True" in proc.stdout
    sp1, sp2 = (max(r["saved_mib"] for r in rows if r["sp_size"] == sp) for sp in (1, 2))
    assert sp2 < sp1  # each SP rank saves its slice's activations, not the whole sample's
