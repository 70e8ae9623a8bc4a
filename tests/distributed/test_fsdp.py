"""FSDP2 on 2 gloo ranks vs one process on the same global batch; the shard plan's rules."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from conftest import FAMILIES, assert_adamw_weights_close, tiny_checkpoint
from multiproc import check_ranks, run_ranks
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from qwenkit import config as qconfig
from qwenkit.distributed import fsdp
from qwenkit.engine.run import train
from qwenkit.model.families import registry as families
from qwenkit.model.modules import module_path
from qwenkit.model.tiny.checkpoint import ensure_checkpoint

# Both sides fp32; sums over ranks and micro-batches run in another order (the bound).
FP32 = dict(rtol=1e-5, atol=1e-5)
LR, STEPS = 2e-3, 3
BASE = [
    f"train.steps={STEPS}",
    f"train.lr={LR}",
    "train.micro_batch_size=2",
    "train.warmup_steps=1",
    "train.resume=none",
    "checkpoint.save_final=false",
    "data.tiny_samples=16",
    "loss.chunk=true",
    "loss.chunk_size=16",  # several chunks per micro-batch
]
RECOMPUTE = "parallel.recompute=[model.language_model.layers.*, model.visual.blocks.*]"
# name -> overrides; the 2-rank runs use grad_accum=1, the 1-process references grad_accum=2, so
# each optimizer step sees the same 4 samples (the sampler's global batches, see qwenkit.data.sampler)
# Recompute has no run of its own: "meta", "offload" and "hf_head_recompute" recompute (with CPU init
# in the last two), and HF's head is checked with recompute, where the KV cache would show.
RUNS_2 = {
    "plain": [],
    "meta": [RECOMPUTE, "model.init_device=meta"],
    "offload": [RECOMPUTE, "parallel.activation_offload=true"],
    "tied": ["model.tie_word_embeddings=true"],
    "cpu_offload": ["parallel.cpu_offload=true"],
    "hsdp": ["parallel.nproc=2", "parallel.hsdp_replicas=2"],  # mesh (2 replicas, 1 shard)
    "bf16": ["parallel.param_dtype=bfloat16", "parallel.reduce_dtype=float32"],
    # HF's own head: training must not build a KV cache (a recomputed layer would extend it twice)
    "hf_head_recompute": ["loss.chunk=false", RECOMPUTE],
}
if fsdp.hsdp_problem(qconfig.load(overrides=["parallel.hsdp_replicas=2", "parallel.backend=gloo"]).parallel):
    del RUNS_2["hsdp"]  # torch < 2.8: the launcher refuses HSDP on gloo (tests/test_launch.py)
# every other family: its tiny model sharded by its own units, each against its own one-process run
OTHER_FAMILIES = {
    name: [f"model.name={name}", f"parallel.shard_patterns=[{', '.join(families.get(name).shard_units)}]"]
    for name in FAMILIES
    if name != "qwen2_5_vl"
}
RUNS_2 |= OTHER_FAMILIES
RUNS_1 = {"plain": [], "tied": ["model.tie_word_embeddings=true"], **OTHER_FAMILIES}
REFERENCE = {name: name if name in RUNS_1 else "plain" for name in RUNS_2}
# bf16 compute against the fp32 reference: bf16 keeps 8 bits of mantissa (relative 4e-3 per op)
TOLERANCE = {"bf16": dict(rtol=2e-2, atol=2e-2)}


def _train_runs(rank, out, runs, grad_accum):
    """Several trainings in one process group; rank 0 saves losses, full weights and the plan."""
    dist.init_process_group("gloo")
    for name, overrides in runs.items():
        cfg = qconfig.load(overrides=BASE + overrides + [f"train.grad_accum={grad_accum}", f"train.output_dir={out}/{name}"])
        trainer = train.run(cfg)
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            losses = [h["loss"] for h in trainer.history]
            norms = [h["grad_norm"] for h in trainer.history]  # before clipping and the AdamW step
            torch.save({"losses": losses, "grad_norms": norms, "state": state}, out / f"{name}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_path):
    # The tiny checkpoints are written once here, as the launcher does, so the ranks only read them.
    ensure_checkpoint(tie_word_embeddings=True)
    for name in OTHER_FAMILIES:
        tiny_checkpoint(name)
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    check_ranks(_train_runs, 1, one, RUNS_1, 2)
    check_ranks(_train_runs, 2, two, RUNS_2, 1)
    return {name: torch.load(one / f"{name}.pt") for name in RUNS_1}, {
        name: torch.load(two / f"{name}.pt") for name in RUNS_2
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS_2))
def test_two_ranks_equal_one_process(runs, name):
    ones, twos = runs
    ref, got = ones[REFERENCE[name]], twos[name]
    assert len(got["losses"]) == STEPS
    tol = TOLERANCE.get(name, FP32)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **tol)
    # AdamW ignores a uniform gradient scale and 3 steps move the weights little: the gradients
    # themselves (their global norm, before clipping) are what shows a wrong cross-rank reduction
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), **tol)
    assert got["state"].keys() == ref["state"].keys()
    if name in TOLERANCE:  # bf16: every element within TOLERANCE
        for key, value in ref["state"].items():
            torch.testing.assert_close(got["state"][key], value, **tol, msg=lambda m, k=key: f"{k}: {m}")
    else:
        assert_adamw_weights_close(got["state"], ref["state"], tol, lr=LR, steps=STEPS)
    # the weights moved: equality is not two untouched copies of the initial model
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.slow
def test_tied_weights_stay_tied_after_sharded_training(runs):
    state = runs[1]["tied"]["state"]
    torch.testing.assert_close(state["lm_head.weight"], state["model.language_model.embed_tokens.weight"], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Plan rules, no process group needed


def test_star_matches_exactly_one_segment(make_model):
    model = make_model()
    names = [n for n, _ in fsdp.match_modules(model, ["model.language_model.layers.*"], "parallel.shard_patterns")]
    assert names == ["model.language_model.layers.0", "model.language_model.layers.1"]


def test_pattern_matching_nothing_is_named(make_model):
    model = make_model()
    with pytest.raises(ValueError, match=r"parallel.shard_patterns: pattern 'model.layers.\*' matches no module"):
        fsdp.match_modules(model, ["model.visual.merger", "model.layers.*"], "parallel.shard_patterns")


def test_tied_embedding_and_head_are_left_to_the_root(make_model):
    model = make_model(tie_word_embeddings=True)
    units = families.units(model, "shard_patterns", qconfig.load().parallel.shard_patterns)  # auto: the family's
    matched = fsdp.match_modules(model, units, "parallel.shard_patterns")
    assert set(fsdp.tied_outside(model, matched)) == {"model.language_model.embed_tokens", "lm_head"}
    untied = make_model()
    assert fsdp.tied_outside(untied, fsdp.match_modules(untied, units, "x")) == {}


def test_recompute_keeps_state_dict_keys_and_outputs(make_model, batch_factory):
    plain, wrapped = make_model(chunk=True, seed=3), make_model(chunk=True, seed=3)
    paths = fsdp.apply_recompute(wrapped, ["model.language_model.layers.*", "model.visual.blocks.*"])
    assert paths == [
        "model.visual.blocks.0",
        "model.visual.blocks.1",
        "model.language_model.layers.0",
        "model.language_model.layers.1",
    ]
    assert plain.state_dict().keys() == wrapped.state_dict().keys()
    batch = batch_factory()
    la, lb = plain(**batch).loss, wrapped(**batch).loss
    la.backward()
    lb.backward()
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    grads = {module_path(n): p.grad for n, p in wrapped.named_parameters()}
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-6, atol=1e-8, msg=lambda m, n=n: f"{n}: {m}")


def _mixed_modalities(rank, out):
    """Rank 0 gets a text-only micro-batch, rank 1 an image batch: FSDP must not deadlock or
    crash (the vision tower runs on every rank), and the gradients equal one process's."""
    from conftest import build_model, make_batch  # tests/ is on the spawned ranks' sys.path

    from qwenkit.model.processor import Processor

    proc = Processor.from_pretrained(ensure_checkpoint())
    batches = [make_batch(proc, images_per_sample=(0, 0), seed=1), make_batch(proc, images_per_sample=(1, 2), seed=2)]
    total = sum((b["labels"][:, 1:] != -100).sum() for b in batches)
    cfg = qconfig.load()
    model = build_model(chunk=True, seed=4)
    model.vision_calls_per_step = 1
    model.train()
    rt = fsdp.Runtime(rank, 2, rank, torch.device("cpu"), "gloo", False)
    fsdp.shard(model, cfg.parallel, fsdp.build_mesh(rt))
    loss = model(**batches[rank], num_items_in_batch=total).loss
    (loss * 2).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    model.eval()  # eval loss (qwenkit.engine.generation.evaluate): in eval mode too, every rank runs the vision tower
    with torch.no_grad():
        evaluated = model(**batches[rank], num_items_in_batch=total).loss
    dist.all_reduce(evaluated)
    if rank == 0:
        ref = build_model(chunk=True, seed=4)
        for b in batches:
            ref(**b, num_items_in_batch=total).loss.backward()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, **FP32, msg=lambda m, n=n: f"{n}: {m}")
        with torch.no_grad():
            want = sum(ref.eval()(**b, num_items_in_batch=total).loss for b in batches)
        torch.testing.assert_close(evaluated, want, **FP32)
        (out / "ok").write_text("ok")


@pytest.mark.slow
def test_ranks_with_and_without_images_agree(two_rank_checks):
    _passed(two_rank_checks, _mixed_modalities)


def _sum_when_asked_to_average() -> None:
    """Make this process's reduce-scatters sum when asked for ReduceOp.AVG, as torch 2.7's gloo does
    (pytorch/pytorch#162338), so that newer torch runs the correction too."""
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # FSDP calls one or the other
        original = getattr(dist, name, None)
        if original is None:
            continue

        def summing(*args, op=dist.ReduceOp.SUM, _original=original, **kwargs):
            return _original(*args, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, **kwargs)

        setattr(dist, name, summing)


def _gradients_averaged(rank, out):
    """2 ranks, each its own input, vs one process on the mean of both losses: with this torch's
    backend as it is, then with reduce-scatters that sum when asked to average (for the rest of
    the process: the last of the checks)."""
    inputs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    parallel = dataclasses.replace(qconfig.load().parallel, shard_patterns=["0", "2"])
    rt = fsdp.Runtime(rank, 2, rank, torch.device("cpu"), "gloo", False)
    for backend_sums in (False, True):
        if backend_sums:
            _sum_when_asked_to_average()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        ref = copy.deepcopy(model)
        plan = fsdp.shard(model, parallel, fsdp.build_mesh(rt))
        model(inputs[rank]).square().mean().backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            (sum(ref(x).square().mean() for x in inputs) / 2).backward()
            for n, p in ref.named_parameters():
                torch.testing.assert_close(
                    grads[n], p.grad, **FP32, msg=lambda m, n=n, s=backend_sums: f"{n} (backend sums: {s}): {m}"
                )
            if backend_sums:
                assert plan.gradient_divisor == 2 and "divided by 2" in plan.describe()
    if rank == 0:
        (out / "ok").write_text("ok")


@pytest.mark.slow
def test_fsdp_averages_gradients_over_ranks(two_rank_checks):
    """The trainer's ``loss * world_size`` assumes FSDP averages; torch 2.7's gloo summed instead."""
    _passed(two_rank_checks, _gradients_averaged)


def _tiny_under_group(rank, root):
    path = ensure_checkpoint(root=root)  # collectively: rank 0 writes, the others wait for it
    assert (path / "model.safetensors").is_file(), f"rank {rank}: no weights in {path}"
    dist.barrier()
    if rank == 0:
        (root / "ok").write_text("ok")


@pytest.mark.slow
def test_tiny_checkpoint_written_under_a_process_group_has_weights(two_rank_checks):
    """transformers' save_pretrained writes weights on rank 0 only under a process group."""
    root = _passed(two_rank_checks, _tiny_under_group)
    (written,) = [p for p in root.iterdir() if p.name.startswith("tiny-")]
    assert (written / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------------------
# FSDP2 on 2 gloo ranks with video rows: one rank's micro-batch has images only (or only text),
# the other's images and a video (two vision-tower calls). FSDP's collectives must still pair up,
# and the gradients must equal one process's over both micro-batches.


def _write_rows(root):
    from PIL import Image
    from videos import write_video

    write_video(root / "clip.avi", 96, 72, 20, 10)
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "red.png")
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    reply = {"role": "assistant", "content": "A red box and a moving square."}
    rows = [
        {"messages": [user("<image>What is it?"), reply], "images": ["red.png"]},
        {"messages": [user("<image>and<video>?"), reply], "images": ["red.png"], "videos": ["clip.avi"]},
        {"messages": [user("No picture today?"), reply]},
    ]
    (root / "data.json").write_text(json.dumps(rows))
    # the families that hear: a micro-batch of rows with and without audio (audio features padded to the longest)
    # on one rank, an image row on the other (its audio tower's idle call), through the data pipeline
    from qwenkit.model.tiny.data import write_tone

    write_tone(root / "low.wav", 300.0, 0.6, 0.5)
    write_tone(root / "high.wav", 3000.0, 1.3, 0.5)
    rows = [
        {"messages": [user("<audio>Which tone?"), reply], "audios": ["low.wav"]},
        {"messages": [user("No sound today?"), reply]},
        {"messages": [user("<image><audio>and<audio>?"), reply], "images": ["red.png"], "audios": ["high.wav", "low.wav"]},
        {"messages": [user("<image>What is it?"), reply], "images": ["red.png"]},
    ]
    (root / "audio.json").write_text(json.dumps(rows))
    return root / "data.json"


def _media_batches(path, ranks_rows, family="qwen2_5_vl"):
    from qwenkit.data import build
    from qwenkit.model.paths import load_processor

    cfg = qconfig.load(overrides=[f"data.path={path}", "data.shuffle=false", "train.micro_batch_size=1",
                                  f"model.name={family}"])  # fmt: skip
    bundle = build(cfg, load_processor(cfg))
    batches = [bundle.collator([bundle.dataset[i] for i in rows]) for rows in ranks_rows]
    for b in batches:
        b.pop("num_samples")
    return batches, sum(b.pop("num_items") for b in batches)


MEDIA_CASES = {"image|image+video": ([0], [1]), "text|image+video": ([2], [1])}  # 1 and 2 idle calls on rank 0
# audio.json's rows: rank 0 audio + text + image-and-two-audios in one micro-batch, rank 1 an image alone
AUDIO_CASES = {name: ([0, 1, 2], [3]) for name in FAMILIES if families.get(name).audio_tokens}


def _different_media(rank, out):
    from conftest import build_model  # tests/ is on the spawned ranks' sys.path

    rt = fsdp.Runtime(rank, 2, rank, torch.device("cpu"), "gloo", False)
    for name, ranks_rows in MEDIA_CASES.items():
        batches, total = _media_batches(out / "data.json", ranks_rows)
        model = build_model(chunk=True, seed=4)
        model.vision_calls_per_step = 2  # images and videos
        model.train()
        fsdp.shard(model, qconfig.load().parallel, fsdp.build_mesh(rt))
        (model(**batches[rank], num_items_in_batch=total).loss * 2).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            ref = build_model(chunk=True, seed=4)
            for b in batches:
                ref(**b, num_items_in_batch=total).loss.backward()
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, **FP32, msg=lambda m, n=n, c=name: f"{c}: {n}: {m}")
            (out / name.replace("|", "-")).write_text("ok")
    for family, ranks_rows in AUDIO_CASES.items():
        batches, total = _media_batches(out / "audio.json", ranks_rows, family)
        assert batches[0]["input_features"].shape[0] == 3 and "input_features" not in batches[1]
        model = build_model(chunk=True, seed=4, name=family)
        model.vision_calls_per_step = 1  # images, no video
        model.train()
        fsdp.shard(model, qconfig.load().parallel, fsdp.build_mesh(rt))
        (model(**batches[rank], num_items_in_batch=total).loss * 2).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        if rank == 0:
            ref = build_model(chunk=True, seed=4, name=family)
            for b in batches:
                ref(**b, num_items_in_batch=total).loss.backward()
            for n, p in ref.named_parameters():
                if p.grad is None:  # frozen (never_trained): no gradient on either side
                    assert n not in grads
                    continue
                torch.testing.assert_close(grads[n], p.grad, **FP32, msg=lambda m, n=n, c=family: f"{c}: {n}: {m}")
            (out / f"audio-{family}").write_text("ok")
    dist.barrier()
    if rank == 0:
        (out / "ok").write_text("ok")


@pytest.mark.slow
def test_ranks_with_different_media_agree(two_rank_checks):
    """Through the data pipeline, ranks whose micro-batches hold different media (images, videos, text; for the
    families that hear, rows with and without audio on one rank and none on the other) give one process's
    gradients."""
    pytest.importorskip("av")
    out = _passed(two_rank_checks, _different_media)
    assert sorted(p.name for p in out.glob("*-*")) == sorted(
        [n.replace("|", "-") for n in MEDIA_CASES] + [f"audio-{f}" for f in AUDIO_CASES])


def _no_view_outputs(rank, out):
    """Qwen3.5's backbone returns the vision tower's per-image outputs, views of one tensor split per
    image; FSDP2 registered its pre-backward hook on each of the root's outputs and warned that an
    in-place op on such a view "will silently drop the pre-backward hook". The sharded root returns
    them detached (nothing reads them, docs/TESTING.md): no warning, and every gradient of a sharded
    Qwen3.5 with images on both ranks equals one process's (a dropped hook would show here)."""
    import warnings

    from conftest import build_model, make_batch, tiny_processor  # tests/ is on the spawned ranks' sys.path

    proc = tiny_processor("qwen3_5")
    batches = [make_batch(proc, images_per_sample=(1, 2), seed=1), make_batch(proc, images_per_sample=(2, 1), seed=2)]
    total = sum((b["labels"][:, 1:] != -100).sum() for b in batches)
    model = build_model(chunk=True, seed=4, name="qwen3_5")
    model.train()
    fsdp.shard(model, qconfig.load(overrides=["model.name=qwen3_5"]).parallel,
               fsdp.build_mesh(fsdp.Runtime(rank, 2, rank, torch.device("cpu"), "gloo", False)))  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(**batches[rank], num_items_in_batch=total).loss
    views = [str(w.message) for w in caught if "view tensor" in str(w.message)]
    assert not views, views
    (loss * 2).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == 0:
        ref = build_model(chunk=True, seed=4, name="qwen3_5")
        for b in batches:
            ref(**b, num_items_in_batch=total).loss.backward()
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, **FP32, msg=lambda m, n=n: f"{n}: {m}")
        (out / "ok").write_text("ok")


def test_qwen3_5_root_returns_no_views_and_every_gradient_arrives(two_rank_checks):
    _passed(two_rank_checks, _no_view_outputs)


# ---------------------------------------------------------------------------------------------
# The checks above in one start of 2 ranks (a start costs seconds of imports per rank): in this
# order, the summing backend last; each writes <out>/<check>/ok on rank 0 when it passed, and a
# check that raises ends the ranks (its traceback printed; the later checks do not run).

TWO_RANK_CHECKS = (_tiny_under_group, _mixed_modalities, _different_media, _no_view_outputs, _gradients_averaged)


def _two_rank_checks(rank, out, names):
    dist.init_process_group("gloo")
    for check in TWO_RANK_CHECKS:
        if check.__name__ in names:
            check(rank, out / check.__name__)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_checks(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("two_rank_checks")
    names = [c.__name__ for c in TWO_RANK_CHECKS]
    for name in names:
        (out / name).mkdir()
    try:
        import av  # noqa: F401 - the video rows need PyAV
    except ImportError:
        names.remove(_different_media.__name__)
    else:
        _write_rows(out / _different_media.__name__)
    return out, run_ranks(_two_rank_checks, 2, out, names)


def _passed(two_rank_checks, check):
    """The folder ``check`` wrote, after asserting that it passed on the ranks."""
    out, codes = two_rank_checks
    folder = out / check.__name__
    assert (folder / "ok").is_file(), f"{check.__name__} did not pass: the ranks exited with {codes} (tracebacks above)"
    return folder


def _meta_init_readers(rank, out, family, path):
    """Meta init on 3 ranks (uneven row shards: 32 rows -> 11, 11, 10; 4 experts -> 2, 2, 0) through each
    weight reader this torch has: DCP's HuggingFaceStorageReader (torch 2.8+) and the safetensors slice reader."""
    from qwenkit.distributed import weights
    from qwenkit.model.families import build as registry

    dist.init_process_group("gloo")
    cfg = qconfig.load(overrides=["model.init_device=meta", f"model.name={family}", f"model.path={path}"])
    rt = fsdp.Runtime(rank, 3, rank, torch.device("cpu"), "gloo", False)
    dcp_reader = weights.HuggingFaceStorageReader
    for name, reader in {"dcp": dcp_reader, "slices": None}.items():
        if name == "dcp" and reader is None:
            continue  # torch < 2.8
        weights.HuggingFaceStorageReader = reader
        model = registry.build(cfg.model, cfg.loss)
        fsdp.shard(model, cfg.parallel, fsdp.build_mesh(rt))
        fsdp.materialize(model, rt.device)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # a row no reader fills stays NaN
        weights.load_hf_weights(model, path)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(state, out / f"{name}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
# Qwen2.5-VL's tiny checkpoint, and (long tier: ~30 s; tests/model/families/test_omni.py reads it in one process) a whole
# Qwen3-Omni one: its thinker's tensors under thinker., each expert's linears apart, fused as read, each rank its experts
@pytest.mark.parametrize("family, whole", [("qwen2_5_vl", False), pytest.param("qwen3_omni_moe", True, marks=[
    pytest.mark.long, pytest.mark.skipif(bool(families.get("qwen3_omni_moe").unavailable()), reason="transformers 5.x")])])  # fmt: skip
def test_meta_init_reads_each_shard_like_from_pretrained(tmp_path, _cache, family, whole):
    from qwenkit.distributed import weights
    from qwenkit.model.families import build as registry

    path = tiny_checkpoint(family, whole=whole)
    check_ranks(_meta_init_readers, 3, tmp_path, family, path)
    ref = registry.build(qconfig.load(overrides=[f"model.name={family}", f"model.path={path}"]).model).state_dict()
    readers = ["slices"] + (["dcp"] if weights.HuggingFaceStorageReader is not None else [])
    for name in readers:
        got = torch.load(tmp_path / f"{name}.pt")
        assert got.keys() == ref.keys(), name
        for key, value in ref.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m, k=key, r=name: f"{r} {k}: {m}")


def _short_job(rank, out, fail_rank):
    """A 2-rank FSDP2 step and a full-tensor gather, then the trainer's teardown; ``fail_rank``
    raises instead, its process group still up (its peer waits in the barrier)."""
    rt = fsdp.Runtime(rank, 2, rank, torch.device("cpu"), "gloo", owns_group=True)
    dist.init_process_group("gloo")
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    fsdp.shard(model, dataclasses.replace(qconfig.load().parallel, shard_patterns=["0", "2"]), fsdp.build_mesh(rt))
    model(torch.randn(5, 4)).square().mean().backward()
    {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if rank == fail_rank:
        raise RuntimeError(f"rank {rank} fails on purpose")
    fsdp.shutdown(rt)
    (out / f"done-{rank}").write_text("")


@pytest.mark.slow
def test_ranks_exit_with_their_own_status_every_time_under_load(tmp_path):
    """At process exit gloo's threads are still running (destroy_process_group does not stop them)
    and, in a rank that raised, the group was never destroyed: interpreter teardown around them
    aborted a rank now and then under load (SIGABRT, "terminate called without an active
    exception"). Short jobs two at a time (4 ranks on the cores: each pair is the other's load,
    where two busy loops used to be), each rank's status must be its own."""
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    # the ranks fork from a server that imported this module once: a job costs its own work only
    multiprocessing.get_context("forkserver").set_forkserver_preload(["multiproc", "test_fsdp"])

    def job(i):
        fail_rank = 1 if i % 4 == 0 else -1  # one job in four: rank 1 raises
        out = tmp_path / str(i)
        out.mkdir()
        return fail_rank, out, run_ranks(_short_job, 2, out, fail_rank, timeout=120, context="forkserver")

    with ThreadPoolExecutor(2) as pool:
        for i, (fail_rank, out, codes) in enumerate(pool.map(job, range(4))):
            if fail_rank < 0:
                assert codes == [0, 0], f"job {i}: exit codes {codes}"
                assert {p.name for p in out.iterdir()} == {"done-0", "done-1"}
            else:  # its own error's status, not 134 (SIGABRT); the peer is stopped by the harness
                assert codes[1] == 1, f"job {i}: exit codes {codes}"
