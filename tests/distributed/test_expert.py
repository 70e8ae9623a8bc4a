"""Expert parallelism (qwenkit/distributed/expert.py) against plain FSDP2 and HF's experts forward.

The reference of a run with ``parallel.ep_size`` is the same ranks with ``ep_size=1`` (plain FSDP2,
itself checked against one process in tests/distributed/test_fsdp.py): the same loss, aux loss and every
gradient. fp32 on both sides; only the order of sums differs (the combine sums a token's top-k
outputs at once, HF's loop adds them expert by expert), hence 1e-5, relative to each gradient's
largest element (the expert gradients are ~1e-4: an absolute 1e-5 would hide a factor of 2).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
from conftest import (
    assert_adamw_weights_close,
    build_model,
    make_batch,
    over_families,
    tiny_checkpoint,
    tiny_processor,
)
from multiproc import check_ranks
from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf_moe

from qwenkit import cli, launch, records
from qwenkit import config as qconfig
from qwenkit.distributed import expert, fsdp
from qwenkit.engine.checkpoints import export
from qwenkit.engine.run import expert_load, train
from qwenkit.model.families import registry as families
from qwenkit.model.families import spec as model_spec
from qwenkit.rundir import RunDir

FP32 = dict(rtol=1e-5, atol=1e-5)


def _experts_module(seed=0, experts=4, hidden=16, inter=8):
    cfg = hf_moe.Qwen3VLMoeTextConfig(num_experts=experts, hidden_size=hidden, moe_intermediate_size=inter, hidden_act="silu")
    module = hf_moe.Qwen3VLMoeTextExperts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_mm"])
def test_local_experts_match_hf_experts(grouped):
    """Rows grouped by expert (one with none) through the local experts = HF's experts forward
    (each row top-1 to its expert, weight 1), outputs and weight gradients."""
    if grouped and not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    module = _experts_module()
    sizes = [3, 0, 5, 2]  # expert 1 gets no row
    rows = torch.randn(sum(sizes), 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes)).unsqueeze(-1)
    ref = module(rows, ids, torch.ones(len(rows), 1))
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in (rows, module.gate_up_proj, module.down_proj)]
    for p in (rows, module.gate_up_proj, module.down_proj):
        p.grad = None
    got = expert.local_experts(rows, sizes, module.gate_up_proj, module.down_proj, module.act_fn, grouped=grouped)
    got.square().sum().backward()
    torch.testing.assert_close(got, ref, **FP32)
    for g, r in zip((rows.grad, module.gate_up_proj.grad, module.down_proj.grad), ref_grads):
        torch.testing.assert_close(g, r, **FP32)
    assert module.gate_up_proj.grad[1].abs().max() == 0  # the idle expert: a zero gradient, not None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_mm_on_cuda_bf16_matches_the_loop_in_fp32():
    """The device's choice (grouped_mm_wanted): one torch._grouped_mm per projection, bf16, 128-aligned groups
    and one empty, against the CPU loop in fp32; bf16 keeps 8 bits of mantissa, sums of 64 terms: 2e-2."""
    module = _experts_module(experts=4, hidden=128, inter=64)
    sizes = [128, 0, 256, 64]
    rows = torch.randn(sum(sizes), 128, generator=torch.Generator().manual_seed(1))
    ref = expert.local_experts(rows, sizes, module.gate_up_proj, module.down_proj, module.act_fn, grouped=False)
    cuda = torch.device("cuda")
    assert expert.grouped_mm_wanted(cuda, torch.bfloat16) and not expert.grouped_mm_wanted(cuda, torch.float32)
    weights = [p.detach().to(cuda, torch.bfloat16) for p in (module.gate_up_proj, module.down_proj)]
    got = expert.local_experts(rows.to(cuda, torch.bfloat16), sizes, *weights, module.act_fn)
    torch.testing.assert_close(got.float().cpu(), ref.detach(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# ep_size=2 vs ep_size=1 on the same ranks


def _route(model, how: str) -> None:
    """``every``: each token to all 4 experts; ``low``: only to experts 0 and 1 (rank 1's experts idle)."""
    text = model.config.text_config
    for layer in model.model.language_model.layers:
        gate = layer.mlp.gate
        if how == "every":
            gate.top_k = text.num_experts_per_tok = text.num_experts
        elif how == "low":
            forward = gate.forward

            def low(hidden, _forward=forward):
                logits, weights, index = _forward(hidden)
                return logits, weights, index % 2

            gate.forward = low


def _loss_and_grads(model, batch):
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.aux_loss.detach(), grads


def _compare_ranks(rank, out, ep_size, routes, family="qwen3_vl_moe"):
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cfg = qconfig.load(overrides=[f"model.name={family}", "loss.chunk=true", "loss.chunk_size=16"])
    mesh = fsdp.build_mesh(fsdp.Runtime(rank, world, rank, torch.device("cpu"), "gloo", False))
    batch = make_batch(tiny_processor(family), images_per_sample=(1, 0), seed=rank)
    report = {}
    for how in routes:
        results = []
        for ep in (1, ep_size):
            model = build_model(chunk=True, seed=0, name=family)
            _route(model, how)
            experts = None
            if ep > 1:
                experts = expert.apply(model, families.get(family).experts, expert.build_expert_mesh("cpu", world, ep))
            fsdp.shard(model, cfg.parallel, mesh, experts)
            results.append(_loss_and_grads(model, batch))
        (loss1, aux1, grads1), (loss2, aux2, grads2) = results
        torch.testing.assert_close(loss2, loss1, **FP32)
        torch.testing.assert_close(aux2, aux1, **FP32)
        assert grads2.keys() == grads1.keys()
        for name, ref in grads1.items():
            scale = dict(rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            torch.testing.assert_close(grads2[name], ref, **scale, msg=lambda m, n=name: f"{n}: {m}")
        idle = [n for n, g in grads2.items() if "experts" in n and g[2:].abs().max() == 0]
        report[how] = {"loss": loss1.item(), "aux": aux1.item(), "idle_expert_grads": len(idle)}
    if rank == 0:
        (out / "report.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


# family -> the routes its 2-rank comparison runs: Qwen3-VL-MoE every route; the others the top-k one (the same
# dispatch): Qwen3.5-MoE's gated shared expert stays a dense weight beside the split routed experts, the Omni
# thinker's experts sit in a decoder beside its audio tower
EP_ROUTES = {"qwen3_vl_moe": ("topk", "every", "low"), "qwen3_5_moe": ("topk",), "qwen3_omni_moe": ("topk",),
             "qwen4_exp": ("topk",)}  # Qwen4-Exp: its experts inside hyper-connection streams, beside PLE


@pytest.mark.slow
@over_families(*EP_ROUTES)
def test_two_ranks_ep2_equal_ep1(tmp_path, family):
    """2 ranks, ep_size=2 (each rank 2 whole experts): loss, aux loss and every gradient = ep_size=1;
    also with every token sent to every expert, and with rank 1's experts given no token at all."""
    tiny_processor(family)  # written once here, read by the ranks
    check_ranks(_compare_ranks, 2, tmp_path, 2, EP_ROUTES[family], family)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["topk"]["idle_expert_grads"] == 0
    if "low" in report:
        assert report["low"]["idle_expert_grads"] == 2 * 3  # both weights of every layer: zero for experts 2, 3


@pytest.mark.slow
@pytest.mark.long  # the 2-rank test above runs the same path (~80 s here)
def test_four_ranks_ep2_by_efsdp2_equal_fsdp(tmp_path):
    """4 ranks, mesh (efsdp 2, ep 2): each expert on 2 ranks, sharded by FSDP between them."""
    tiny_processor("qwen3_vl_moe")
    check_ranks(_compare_ranks, 4, tmp_path, 2, ("topk",))


@pytest.mark.parametrize("model, refusal", [
    ("qwen2_5_vl", "parallel.ep_size=2: qwen2_5_vl has no routed experts to split (a dense family)"),
    ("qwen3_vl_moe", None),
])  # fmt: skip
def test_the_launcher_refuses_ep_on_a_dense_family_before_spawning(tmp_path, monkeypatch, capsys, model, refusal):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: 0)  # a run that would start reports success
    out = tmp_path / "run"
    code = cli.main(["train", "--nproc", "2", "parallel.allow_oversubscribe=true", "parallel.ep_size=2",
                     f"model.name={model}", f"train.output_dir={out}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == (2 if refusal else 0), err
    if refusal:
        assert refusal in err and not out.exists()


# ---------------------------------------------------------------------------------------------
# Through the trainer: losses, grad norms, checkpoints (2 ranks, one process group for every run)

LR, STEPS = 2e-3, 4
TRAIN = [
    "model.name=qwen3_vl_moe", f"train.steps={STEPS}", f"train.lr={LR}", "train.micro_batch_size=2",
    "train.warmup_steps=1", "data.tiny_samples=16", "loss.chunk=true", "loss.chunk_size=16",
    "checkpoint.every=2", "checkpoint.keep_last=2", "train.max_grad_norm=1.0",
    # eval loss and greedy replies at steps 0 and 4 (held-out rows: the training batches stay the same)
    "data.tiny_eval_samples=4", "train.eval_samples=2", "train.eval_max_new_tokens=4",
]  # fmt: skip
RUNS = {
    "ep1": [],
    "ep2": ["parallel.ep_size=2"],
    # each rank reads only its experts' rows from the HF files; recompute re-runs the exchanges in backward
    # lockstep: the replies generated on the sharded model, every rank's exchanges in step
    "ep2_meta": ["parallel.ep_size=2", "model.init_device=meta", "parallel.recompute=[model.language_model.layers.*]",
                 "train.eval_generation=lockstep"],
    "ep2_bf16": ["parallel.ep_size=2", "parallel.param_dtype=bfloat16", "parallel.reduce_dtype=float32"],
    "ep1_from_ep2": ["train.resume=auto"],  # ep2's step-2 checkpoint, resumed without EP
}
# bf16 compute against the fp32 reference: bf16 keeps 8 bits of mantissa (relative 4e-3 per op), as tests/distributed/test_fsdp.py
TOLERANCE = {"ep2_bf16": dict(rtol=2e-2, atol=2e-2)}


def _train(rank, out):
    dist.init_process_group("gloo")
    for name, overrides in RUNS.items():
        run_dir = out / name
        if name == "ep1_from_ep2" and rank == 0:
            step = "step-00000002"
            shutil.copytree(out / "ep2" / "checkpoints" / step, run_dir / "checkpoints" / step)
        dist.barrier()
        resume = [] if "train.resume=auto" in overrides else ["train.resume=none"]
        cfg = qconfig.load(overrides=[*TRAIN, *resume, *overrides, "parallel.nproc=2", f"train.output_dir={run_dir}"])
        trainer = train.run(cfg)
        if rank == 0:
            (run_dir / "result.json").write_text(json.dumps({
                "start": trainer.start_step,
                "losses": [h["loss"] for h in trainer.history],
                "grad_norms": [h["grad_norm"] for h in trainer.history],
            }))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tiny_processor("qwen3_vl_moe")
    out = tmp_path_factory.mktemp("ep")
    check_ranks(_train, 2, out)
    return out


def _result(out, name):
    return json.loads((out / name / "result.json").read_text())


def _evaluated(out, name, metric):
    rows = records.read_jsonl(RunDir(out / name).metrics / "rank-00000.jsonl")
    return {r["x"]: r["value"] for r in rows if r["metric"] == metric}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep2", "ep2_meta", "ep2_bf16"])
def test_trainer_with_ep_size_2_logs_the_losses_of_ep_size_1(trained, name):
    ref, got = _result(trained, "ep1"), _result(trained, name)
    assert len(got["losses"]) == STEPS
    tol = TOLERANCE.get(name, FP32)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **tol)
    # the grad norm counts each expert once (before clipping)
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), **tol)
    want = _evaluated(trained, "ep1", "eval_loss")
    assert sorted(want) == [0, STEPS]
    torch.testing.assert_close(_evaluated(trained, name, "eval_loss"), want, **tol)
    assert sorted(_evaluated(trained, name, "eval_accuracy")) == [0, STEPS]  # the replies were generated


@pytest.mark.slow
def test_a_checkpoint_saved_under_ep_2_resumes_under_ep_1_with_the_uninterrupted_losses(trained):
    ref, got = _result(trained, "ep1"), _result(trained, "ep1_from_ep2")
    assert got["start"] == 2
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"][2:]), **FP32)


@pytest.mark.slow
def test_an_ep_2_checkpoint_exports_the_hf_keys_of_ep_1(trained):
    """The experts are saved under HF's keys with their global shape: the export is HF's model."""
    cfg = qconfig.load(overrides=[*TRAIN, "parallel.nproc=2"])
    final = "checkpoints/step-00000004"
    spec = model_spec.of_run(cfg.model)
    got, ref = (export.load_hf(trained / run / final, cfg, spec).state_dict() for run in ("ep2", "ep1"))
    key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert got[key].shape == ref[key].shape and got[key].shape[0] == 4  # all 4 experts, as EP 1 holds them
    assert_adamw_weights_close(got, ref, FP32, lr=LR, steps=STEPS)


# ---------------------------------------------------------------------------------------------
# Every objective and parallel setting under EP (2 ranks, one process group), each against the same run
# with ep_size=1: DPO's and GRPO's references are the trainer's own build, their experts split as the
# policy's; GRPO's rollouts and the held-out replies are generated on the sharded policy (lockstep) and
# from a gathered copy with the router's aux loss on; LoRA (attention), HSDP and Ulysses SP

# the MoE families that take expert parallelism (an entry that refuses it is not run)
MOE = tuple(n for n in families.FAMILIES if families.get(n).experts and "expert parallelism" not in families.get(n).not_exact)
VARIANT_STEPS = 2
OBJECTIVES = {
    "dpo": ["train.objective=dpo", "dpo.sft_weight=0"],
    "grpo": ["train.objective=grpo", "grpo.num_generations=4", "grpo.max_new_tokens=6", "grpo.beta=0.04",
             "grpo.rewards=[format, engine.objectives.test_grpo:vowels]", "grpo.reward_weights=[1, 2]",
             "train.eval_generation=lockstep"],
}  # fmt: skip
NO_AUX = "no-aux"  # the tiny qwen3_vl_moe with output_router_logits off (SP refuses the router's aux loss)
# (family, objective or setting) -> overrides
VARIANTS = {
    **{(family, name): overrides for family in MOE for name, overrides in OBJECTIVES.items()},
    ("qwen3_vl_moe", "lora"): ["lora.r=4", "lora.alpha=8"],
    # the experts' fused weights adapted too: peft's wrappers under FSDP2 (ep 1), each rank's experts' deltas (ep 2)
    **{(family, "lora_experts"): ["lora.r=4", "lora.alpha=8", "lora.target_experts=true"] for family in MOE},
    # DPO's reference: the policy with every adapter off, the experts' too (on each rank's own experts under EP)
    ("qwen3_vl_moe", "dpo_lora_experts"): [*OBJECTIVES["dpo"], "lora.r=4", "lora.alpha=8", "lora.target_experts=true"],
    # 2 replicas of 1 shard each: the dense weights replicated, the experts split over ep as without HSDP
    ("qwen3_vl_moe", "hsdp"): ["parallel.hsdp_replicas=2"],
    ("qwen3_vl_moe", "sp"): ["parallel.sp_size=2", "loss.chunk=true", "train.micro_batch_size=2"],
}
# max_grad_norm=0: the updates themselves are compared; a held-out evaluation (loss, or replies in batches
# of 2 prompts of different lengths) at step 0 and at the end
VARIANT_BASE = [
    f"train.steps={VARIANT_STEPS}", f"train.lr={LR}", "train.warmup_steps=0", "train.max_grad_norm=0",
    "train.micro_batch_size=1", "data.tiny_samples=8", "data.tiny_eval_samples=4", "train.eval_samples=4",
    "train.eval_batch_size=2", "train.eval_max_new_tokens=4", "train.resume=none", "checkpoint.save_final=true",
    "parallel.nproc=2",
]  # fmt: skip


def _variant_cfg(out, family, name, *overrides):
    path = [f"model.path={out / NO_AUX}"] if name == "sp" else []
    return qconfig.load(overrides=[*VARIANT_BASE, *VARIANTS[family, name], f"model.name={family}", *path, *overrides])


def _train_variants(rank, out, keys):
    dist.init_process_group("gloo")
    for family, name in keys:
        for ep in (1, 2):
            run_dir = out / f"{family}-{name}-ep{ep}"
            trainer = train.run(_variant_cfg(out, family, name, f"parallel.ep_size={ep}", f"train.output_dir={run_dir}"))
            reference = getattr(trainer.objective, "reference", None)  # GRPO's frozen model; DPO's Reference holds it
            reference = reference.model if name == "dpo" else reference
            if rank == 0:
                layouts = [_experts_layout(m) for m in (trainer.model, reference) if isinstance(m, torch.nn.Module)]
                (run_dir / "result.json").write_text(json.dumps({"history": trainer.history, "evals": trainer.evals,
                                                                 "layouts": layouts}))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _experts_layout(model) -> list[list[str]]:
    """How each fused expert weight is split (not its LoRA adapters): its name, mesh dimensions and placements."""
    return [[n, str(p.device_mesh.mesh_dim_names), str(p.placements)] for n, p in model.named_parameters()
            if ".experts." in n and n.rpartition(".")[2] in ("gate_up_proj", "down_proj")]  # fmt: skip


# the Omni MoE thinker's variants (~20 s more on 2 quiet CPU ranks, ~60 s loaded) run in the long tier: its EP dispatch is
# test_two_ranks_ep2_equal_ep1's in make test, and each objective runs for it in one process there
LONG_VARIANTS = tuple(k for k in VARIANTS if families.get(k[0]).audio_tokens)


def _variants(tmp_path_factory, keys):
    for family in {f for f, _ in keys}:
        tiny_processor(family)
    out = tmp_path_factory.mktemp("ep-variants")
    shutil.copytree(tiny_checkpoint("qwen3_vl_moe"), out / NO_AUX)
    config = json.loads((out / NO_AUX / "config.json").read_text())
    config["text_config"]["output_router_logits"] = False
    (out / NO_AUX / "config.json").write_text(json.dumps(config))
    check_ranks(_train_variants, 2, out, keys)
    return out


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    return _variants(tmp_path_factory, [k for k in VARIANTS if k not in LONG_VARIANTS])


@pytest.fixture(scope="module")
def long_variants(tmp_path_factory):
    return _variants(tmp_path_factory, LONG_VARIANTS)


TIMING = {"step_time", "tokens_per_s", "samples_per_s", "peak_memory", "eval_generation_time", "rollout_time"}


@pytest.mark.slow
@pytest.mark.parametrize("family, name", [pytest.param(f, n, id=f"{f}-{n}", marks=[pytest.mark.long] if (f, n) in LONG_VARIANTS
                                                   else []) for f, n in VARIANTS])  # fmt: skip
def test_every_objective_and_setting_with_ep_size_2_trains_as_ep_size_1(request, family, name):
    """Every logged value (loss, grad norm, the objective's metrics: DPO's rewards, GRPO's rewards, KL
    and lengths; eval loss or accuracy) and the final weights of ep_size=2 equal ep_size=1's (fp32)."""
    variants = request.getfixturevalue("long_variants" if (family, name) in LONG_VARIANTS else "variants")
    runs = {ep: variants / f"{family}-{name}-ep{ep}" for ep in (1, 2)}
    ref, got = (json.loads((runs[ep] / "result.json").read_text()) for ep in (1, 2))
    policy, *reference = got["layouts"]
    assert all("'ep'" in mesh for _, mesh, _ in policy)
    assert reference == ([policy] if name in OBJECTIVES else [])  # a frozen reference's experts: the policy's split
    assert all(h["grad_norm"] > 0 for h in ref["history"])  # something trains
    assert len(got["history"]) == VARIANT_STEPS and [e["step"] for e in got["evals"]] == [0, VARIANT_STEPS]
    for a, b in zip(got["history"] + got["evals"], ref["history"] + ref["evals"], strict=True):
        assert a.keys() == b.keys()
        for key in a.keys() - TIMING:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    # the expert load (qwenkit/engine/run/expert_load.py): logged every step, its file at the logged steps, the
    # global step's counts under either split
    assert all(h["expert_load/max_over_mean"] >= 1.0 for h in got["history"])
    loads = [expert_load.read(runs[ep]) for ep in (1, 2)]
    assert [r["step"] for r in loads[1]] == list(range(1, VARIANT_STEPS + 1))  # train.log_every=1
    for a, b in zip(*loads):
        torch.testing.assert_close(torch.tensor(b["fractions"]), torch.tensor(a["fractions"]), **FP32)
    if name == "grpo":  # the rollouts sampled the same completions; the held-out replies are the same
        from qwenkit.engine.objectives import completions

        assert completions.read_completions(runs[2]) == completions.read_completions(runs[1])
        replies = [records.read_jsonl(runs[ep] / "eval" / f"step-{VARIANT_STEPS:06d}.jsonl") for ep in (1, 2)]
        assert replies[0] == replies[1] and len(replies[0]) == 4
    cfg = _variant_cfg(variants, family, name)
    final = f"checkpoints/step-{VARIANT_STEPS:08d}"
    got_w, ref_w = (export.load_hf(runs[ep] / final, cfg, model_spec.of_run(cfg.model)).state_dict() for ep in (2, 1))
    assert_adamw_weights_close(got_w, ref_w, FP32, lr=LR, steps=VARIANT_STEPS)
