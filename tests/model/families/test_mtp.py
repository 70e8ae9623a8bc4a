"""Qwen3.5's multi-token-prediction layer trained beside the model (``model.mtp.train``, :mod:`qwenkit.model.families.mtp`).

- the chunked MTP loss = a full-logits reference of the same layer written here from vLLM's definition
  (fc over concat(norm(embed of token t+1), norm(h_t)), the decoder layer, the norm, the shared lm_head,
  target t+2), loss and every gradient (fp32);
- a packed row = the padded batch (no prediction across a document boundary);
- through the trainer: ``mtp_loss`` logged, the export's ``mtp.*`` = the trained tensors (not the base's),
  HF's class loads the export;
- FSDP2 on 2 gloo ranks (CPU init; meta init with recompute) = one process on the same global batches: losses, ``mtp_loss``,
  gradient norms, the trained weights (``mtp.*`` included), eval loss and ``eval_mtp_acceptance``;
- a family without an MTP layer asked to train it: refused before start in one line.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import assert_adamw_weights_close, over_families, tiny_checkpoint
from multiproc import check_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from qwenkit import cli, launch
from qwenkit import config as qconfig
from qwenkit.model.families import registry as families
from qwenkit.model.families.build import build
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX

TIGHT = dict(rtol=1e-5, atol=1e-6)  # fp32, the same GEMMs in chunks


def _model(family, weight=0.1):
    cfg = qconfig.load(overrides=[f"model.path={tiny_checkpoint(family)}", f"model.name={family}",
                                  "model.mtp.train=true", f"model.mtp.loss_weight={weight}"])  # fmt: skip
    torch.manual_seed(0)
    return build(cfg.model, cfg.loss).train()


def _reference_mtp_loss(model, ids, labels):
    """vLLM's layer (qwen3_5_mtp.py) by hand, full [B, S, V] logits, torch's cross-entropy on t+2."""
    lm = model.model.language_model
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    mtp = model.mtp
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    x = torch.cat([mtp.pre_fc_norm_embedding(lm.embed_tokens(nxt)), mtp.pre_fc_norm_hidden(hidden)], dim=-1)
    x = mtp.fc(x)
    pos = torch.arange(ids.shape[1])[None, None].expand(3, ids.shape[0], -1)  # text-only mRoPE: t, h, w alike
    x = mtp.layers[0](x, position_embeddings=lm.rotary_emb(x, pos), attention_mask=None, position_ids=pos[0])
    logits = model.lm_head(mtp.norm(x))  # [B, S, V]
    main = F.cross_entropy(model.lm_head(hidden)[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX)
    extra = F.cross_entropy(logits[:, :-2].flatten(0, 1), labels[:, 2:].flatten(), ignore_index=IGNORE_INDEX)
    return main, extra


@over_families("qwen3_5", "qwen3_5_moe")
def test_chunked_mtp_loss_equals_a_full_logits_reference_with_its_gradients(family):
    model = _model(family)
    if family == "qwen3_5_moe":
        model.config.text_config.output_router_logits = False  # the reference has no router loss
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.text_config.vocab_size, (2, 11), generator=g)
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX
    out = model(input_ids=ids, labels=labels, use_cache=False)
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert any(n.startswith("mtp.layers.0.self_attn") for n in got) and "mtp.fc.weight" in got
    model.zero_grad()
    main, extra = _reference_mtp_loss(model, ids, labels)
    torch.testing.assert_close(model.last_mtp_loss, extra.detach(), **TIGHT)
    (main + 0.1 * extra).backward()
    torch.testing.assert_close(out.loss.detach(), (main + 0.1 * extra).detach(), **TIGHT)
    for name, p in model.named_parameters():
        if name in got:
            torch.testing.assert_close(got[name], p.grad, **TIGHT, msg=name)


@over_families("qwen3_5")
def test_a_packed_row_equals_the_padded_batch(family):
    """Two samples (7 and 5 tokens): padded [2, 7] vs packed [1, 12]; the packed row's MTP never predicts
    across the boundary, so MTP loss and gradients agree."""
    model = _model(family, weight=1.0)
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, model.config.text_config.vocab_size, (n,), generator=g) for n in (7, 5))
    pad = torch.zeros(2, 7, dtype=torch.long)
    pad[0], pad[1, :5] = a, b
    mask = (torch.arange(7)[None] < torch.tensor([[7], [5]])).long()
    labels = pad.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, 0] = IGNORE_INDEX
    model(input_ids=pad, labels=labels, attention_mask=mask, use_cache=False).loss.backward()
    padded = model.last_mtp_loss
    grads = {n: p.grad.clone() for n, p in model.mtp.named_parameters()}
    model.zero_grad()
    row = torch.cat([a, b])[None]
    row_labels = row.clone()
    row_labels[0, [0, 7]] = IGNORE_INDEX
    model(input_ids=row, labels=row_labels, packed_seq_lens=torch.tensor([7, 5]), use_cache=False).loss.backward()
    torch.testing.assert_close(model.last_mtp_loss, padded, **TIGHT)
    for name, p in model.mtp.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)


@over_families("qwen3_5")
def test_trained_through_the_trainer_logged_and_exported_under_the_checkpoints_names(family, tmp_path):
    from safetensors import safe_open

    from qwenkit.engine.checkpoints import export as hf_export
    from qwenkit.engine.run import metrics, train

    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint(family), base)
    run = tmp_path / "run"
    cfg = qconfig.load(overrides=[f"model.path={base}", f"model.name={family}", "model.mtp.train=true", "train.steps=2",
                                  "data.tiny_samples=4", "train.micro_batch_size=2", "train.resume=none",
                                  "train.warmup_steps=1", "train.eval_samples=0", "train.lr=1e-2",
                                  f"train.output_dir={run}"])  # fmt: skip
    train.run(cfg)
    rows = [r for r in metrics.read(run) if r["metric"] == "mtp_loss"]
    assert len(rows) == 2 and all(r["value"] > 0 for r in rows)
    saved = hf_export.trained_mtp(hf_export.resolve(run))
    exported = hf_export.export(run, tmp_path / "hf", cfg)
    index = json.loads((exported / hf_export.INDEX).read_text())["weight_map"]
    with safe_open(base / "model.safetensors", framework="pt") as f:
        before = {k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")}
    assert set(saved) == set(before) == {k for k in index if k.startswith("mtp.")}
    for key, value in saved.items():
        with safe_open(exported / index[key], framework="pt") as f:
            assert torch.equal(f.get_tensor(key), value)
    assert not torch.equal(saved["mtp.fc.weight"], before["mtp.fc.weight"])  # trained, not the base's
    families.get(family).load("hf_class").from_pretrained(exported)  # HF's class loads the export


LORA = ["lora.r=4", "lora.alpha=8"]


@over_families("qwen3_5", "qwen3_5_moe")
def test_lora_adapts_the_mtp_layer_and_its_loss_trains_the_adapters(family):
    """``all-linear`` puts adapters on the MTP layer's fc, attention and MLP (never a MoE's routers), and they
    alone of it train; with lora_B = 0 at the start each B's gradient is the MTP loss's (the main loss does
    not reach the layer), and with the MTP weight doubled it doubles."""
    from qwenkit.model import lora

    grads = {}
    for weight in (0.5, 1.0):
        cfg = qconfig.load(overrides=[f"model.path={tiny_checkpoint(family)}", f"model.name={family}", *LORA,
                                      "model.mtp.train=true", f"model.mtp.loss_weight={weight}"])  # fmt: skip
        model = build(cfg.model, cfg.loss).train()
        targets = [t for t in lora.apply(model, cfg.lora, seed=0) if t.startswith("mtp.")]
        assert "mtp.fc" in targets and "mtp.layers.0.self_attn.q_proj" in targets and "mtp.layers.0.self_attn.o_proj" in targets
        assert any(t.startswith("mtp.layers.0.mlp.") and t.endswith("down_proj") for t in targets)
        assert not any(t.endswith((".mlp.gate", "shared_expert_gate")) for t in targets)
        ids = torch.randint(0, model.config.text_config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        trained = {n: p for n, p in model.named_parameters() if n.startswith("mtp.") and p.requires_grad}
        assert trained and all(lora.is_adapter_key(n) for n in trained)
        grads[weight] = {n: p.grad.clone() for n, p in trained.items() if ".lora_B." in n}
        assert len(grads[weight]) == len(targets) and all(g.abs().sum() > 0 for g in grads[weight].values())
    for name, grad in grads[1.0].items():
        torch.testing.assert_close(grad, 2 * grads[0.5][name], **TIGHT, msg=name)


@over_families("qwen3_5")
def test_lora_through_the_trainer_exports_the_mtp_layer_merged_as_base_plus_delta(family, tmp_path):
    """The export's ``mtp.*`` (merged, and beside the adapter directory) = the base's weight + alpha/r B A of
    the run's trained adapters, under the checkpoint's names; peft's adapter file holds HF's class's adapters only."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from qwenkit.engine.checkpoints import export as hf_export
    from qwenkit.engine.run import train

    base = tiny_checkpoint(family)
    run = tmp_path / "run"
    cfg = qconfig.load(overrides=[f"model.path={base}", f"model.name={family}", "model.mtp.train=true", "train.steps=2",
                                  "data.tiny_samples=4", "train.micro_batch_size=2", "train.resume=none", *LORA,
                                  "train.warmup_steps=1", "train.eval_samples=0", "train.lr=1e-2",
                                  f"train.output_dir={run}"])  # fmt: skip
    train.run(cfg)
    adapters = hf_export.trained_mtp(hf_export.resolve(run))  # the checkpoint holds what trains: the adapters
    with safe_open(base / "model.safetensors", framework="pt") as f:
        before = {k: f.get_tensor(k) for k in f.keys() if k.startswith("mtp.")}
    expected = dict(before)
    for key in adapters:
        if ".lora_A." in key:
            module = key.removesuffix(".lora_A.default.weight")
            delta = adapters[f"{module}.lora_B.default.weight"] @ adapters[key]
            expected[f"{module}.weight"] = before[f"{module}.weight"] + 8 / 4 * delta
    assert len(adapters) == 2 * 8 and all(lora_b.abs().sum() > 0 for k, lora_b in adapters.items() if ".lora_B." in k)
    merged = hf_export.export(run, tmp_path / "merged", cfg, merge=True)
    adapter = hf_export.export(run, tmp_path / "adapter", cfg)
    index = json.loads((merged / hf_export.INDEX).read_text())["weight_map"]
    assert {k for k in index if k.startswith("mtp.")} == set(before)
    for out in (merged, adapter):
        got = load_file(out / hf_export.MTP_FILE)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, **TIGHT, msg=lambda m, k=key, o=out.name: f"{o} {k}: {m}")
    assert not torch.equal(expected["mtp.fc.weight"], before["mtp.fc.weight"])
    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as f:
        assert f.keys() and not any(".mtp." in k for k in f.keys())
    assert not any(t.startswith("mtp.") for t in json.loads((adapter / "adapter_config.json").read_text())["target_modules"])
    families.get(family).load("hf_class").from_pretrained(merged)  # HF's class loads the merged export


@pytest.mark.parametrize("keys, said", [
    (["model.name=qwen2_5_vl"], "model.mtp.train: qwen2_5_vl has no multi-token-prediction layer"),
    (["model.name=qwen3_5", "model.mtp.layers=2"], "model.mtp.layers=2: qwen3_5's checkpoints hold 1"),
])  # fmt: skip
def test_mtp_a_model_cannot_train_is_refused_before_start(tmp_path, monkeypatch, capsys, keys, said):
    """A family without the layer, or more depths than its checkpoints hold (never a random layer trained)."""
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun must not start"))
    out = tmp_path / "run"
    assert cli.main(["train", *keys, "model.mtp.train=true", f"train.output_dir={out}"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "model.mtp" in line]
    assert len(lines) == 1 and said in lines[0], lines
    assert not out.exists()


def test_an_entry_without_an_mtp_tower_refuses_lora_with_mtp_training():
    """Qwen4-Exp's entry gives LoRA no adapters on its MTP layer: the layer would stay frozen, its loss training
    nothing; the Qwen3.5 entries have the tower."""
    cfg = qconfig.load(overrides=["model.mtp.train=true", "lora.r=4"])
    said = [p for p in families.get("qwen4_exp").problems(cfg) if p.startswith("model.mtp.train")]
    assert said == ["model.mtp.train: lora.r=4 would freeze qwen4_exp's MTP layer (its entry gives LoRA no adapters "
                    "there); use lora.r=0 or model.mtp.train=false"]  # fmt: skip
    assert not [p for f in ("qwen3_5", "qwen3_5_moe") for p in families.get(f).problems(cfg) if p.startswith("model.mtp")]


LR, STEPS = 2e-3, 3
FP32 = dict(rtol=1e-5, atol=1e-5)  # fp32 both sides; sums over ranks and micro-batches run in another order
RANKS_BASE = [f"train.steps={STEPS}", f"train.lr={LR}", "train.micro_batch_size=2", "train.warmup_steps=1",
              "train.resume=none", "checkpoint.save_final=false", "data.tiny_samples=16", "loss.chunk_size=16",
              "model.mtp.train=true", "model.mtp.loss_weight=0.5", "data.tiny_eval_samples=5",
              "train.eval_samples=0"]  # fmt: skip
# the 2-rank runs take grad_accum=1, the one-process reference grad_accum=2: the same 4 samples per step
RANKS_RUNS = {"cpu": [], "meta": ["model.init_device=meta", "parallel.recompute=auto"],  # recompute: the hook refires
              "lora": LORA}  # fmt: skip
REFERENCE = {"cpu": "cpu", "meta": "cpu", "lora": "lora"}  # each 2-rank run's one-process twin
RANKS_KEYS = ("loss", "mtp_loss", "grad_norm", "eval_loss", "eval_mtp_acceptance")  # eval: at the last step


def _train_ranks(rank, out, family, runs, grad_accum):
    from qwenkit.engine.run import train

    dist.init_process_group("gloo")
    for name, overrides in runs.items():
        cfg = qconfig.load(overrides=RANKS_BASE + [f"model.path={tiny_checkpoint(family)}", f"model.name={family}",
                                                   f"train.grad_accum={grad_accum}", f"train.output_dir={out}/{name}",
                                                   *overrides])  # fmt: skip
        trainer = train.run(cfg)
        state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        trained = sorted(n.replace("._checkpoint_wrapped_module", "") for n, p in trainer.model.named_parameters()
                         if p.requires_grad)  # fmt: skip
        layout = {n: str(p.device_mesh.mesh_dim_names) for n, p in trainer.model.named_parameters()
                  if n.startswith("mtp.") and n.rpartition(".")[2] in ("gate_up_proj", "down_proj")}  # fmt: skip
        if rank == 0:
            torch.save({key: [h[key] for h in trainer.history if key in h] for key in RANKS_KEYS}
                       | {"state": state, "trained": trained, "layout": layout}, out / f"{name}.pt")  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def _assert_same_runs(got, ref, name):
    for key in RANKS_KEYS:
        assert len(got[key]) == len(ref[key]), (name, key)
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), **FP32, msg=lambda m, k=key: f"{name} {k}: {m}")
    assert got["trained"] == ref["trained"]
    assert_adamw_weights_close(got["state"], ref["state"], FP32, lr=LR, steps=STEPS, trained=got["trained"])
    adapters = [n for n in got["trained"] if n.startswith("mtp.") and ".lora_B." in n]
    if adapters:  # the MTP layer's adapters trained (B moved off zero), its base weights did not (the check above)
        assert all(got["state"][n].abs().sum() > 0 for n in adapters)
    else:  # the head trained: not two untouched copies
        assert got["mtp_loss"][-1] < got["mtp_loss"][0]


@pytest.mark.slow
@over_families("qwen3_5")
def test_two_ranks_equal_one_process(family, tmp_path):
    tiny_checkpoint(family)  # written once here, so the ranks only read it
    one, two = tmp_path / "one", tmp_path / "two"
    check_ranks(_train_ranks, 1, one, family, {n: RANKS_RUNS[n] for n in set(REFERENCE.values())}, 2, timeout=600)
    check_ranks(_train_ranks, 2, two, family, RANKS_RUNS, 1, timeout=600)
    for name in RANKS_RUNS:
        ref, got = torch.load(one / f"{REFERENCE[name]}.pt"), torch.load(two / f"{name}.pt")
        assert len(got["loss"]) == STEPS and len(got["eval_mtp_acceptance"]) == 1  # 5 rows: rank 1 runs a filler
        _assert_same_runs(got, ref, name)
        mtp_trained = [n for n in got["trained"] if n.startswith("mtp.")]
        if name == "lora":
            assert mtp_trained and all(".lora_" in n for n in mtp_trained)
        else:
            assert "mtp.fc.weight" in mtp_trained and any(n.startswith("mtp.layers.0.self_attn") for n in mtp_trained)


# expert parallelism through the MTP layer of Qwen3.5-MoE: ep_size=2 against ep_size=1 on the same 2 ranks
EP_RUNS = {"ep1": [], "ep2": ["parallel.ep_size=2"],
           "ep1_lora": [*LORA, "lora.target_experts=true"], "ep2_lora": [*LORA, "lora.target_experts=true", "parallel.ep_size=2"]}  # fmt: skip
EP_RUNS = {name: ["parallel.nproc=2", *overrides] for name, overrides in EP_RUNS.items()}


@pytest.mark.slow
@over_families("qwen3_5_moe")
def test_ep_2_splits_the_mtp_layers_experts_and_trains_as_ep_1(family, tmp_path):
    """The MTP layer's routed experts on the (efsdp, ep) mesh as the backbone's; losses (with the router's aux
    loss), mtp_loss, grad norms, eval and the weights (the MTP experts' and their adapters included) = ep_size=1's."""
    tiny_checkpoint(family)
    check_ranks(_train_ranks, 2, tmp_path, family, EP_RUNS, 1, timeout=900)
    for name in ("ep2", "ep2_lora"):
        got, ref = torch.load(tmp_path / f"{name}.pt"), torch.load(tmp_path / f"{name.replace('ep2', 'ep1')}.pt")
        assert got["layout"] and all("'ep'" in mesh for mesh in got["layout"].values()), got["layout"]
        assert not any("'ep'" in mesh for mesh in ref["layout"].values())
        _assert_same_runs(got, ref, name)
        assert any(n.startswith("mtp.layers.0.mlp.experts.") for n in got["trained"])  # its experts (or their adapters) train


# Ulysses SP through the MTP layer: one group of 2 ranks (grad_accum=2: the 4 samples of the one-process step)
SP_RUNS = {"sp": ["parallel.nproc=2", "parallel.sp_size=2", "train.grad_accum=2"],
           "sp_packed": ["parallel.nproc=2", "parallel.sp_size=2", "train.grad_accum=2", "data.packing=true"]}  # fmt: skip
SP_REFERENCE = {"sp": ("cpu", []), "sp_packed": ("packed", ["data.packing=true"])}


@pytest.mark.slow
@over_families("qwen3_5")
def test_sp_2_equals_sp_1_through_the_mtp_layer(family, tmp_path):
    """parallel.sp_size=2 (each rank a slice of every row, the MTP layer's shifted ids and targets taken across
    the slice boundary, its attention Ulysses') = one process: losses, mtp_loss, grad norms, eval, weights;
    padded and packed rows."""
    tiny_checkpoint(family)
    one, two = tmp_path / "one", tmp_path / "two"
    check_ranks(_train_ranks, 1, one, family, dict(SP_REFERENCE.values()), 2, timeout=600)
    check_ranks(_train_ranks, 2, two, family, SP_RUNS, 1, timeout=600)
    for name, (reference, _) in SP_REFERENCE.items():
        _assert_same_runs(torch.load(two / f"{name}.pt"), torch.load(one / f"{reference}.pt"), name)
