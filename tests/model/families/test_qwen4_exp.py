"""Qwen4-Exp against transformers' own Qwen4-Exp code (transformers >= 5.23; skipped where it is missing).

- packed rows: loss and every gradient of a packed row equal the padded batch's (DeltaNet's conv and state,
  the QSA indexer's compressed blocks, PLE's n-grams and dilated conv all restart at each sample); with
  HF's PLE forward put back (:func:`qwenkit.model.families.ple.revert`) the packed row differs (the leak shows);
- the QSA indexer: HF's forward gives its weights no gradient (a top-k selection), so the entry freezes it;
- refused before any process starts: sequence parallelism (the indexer's blocks), flash attention, CPU offload
  (the n-gram tables are column-sharded outside FSDP2, whose offload does not reach them),
  vLLM rollouts, and a transformers before 5.23;
- SFT, DPO and GRPO through ``qwenkit train`` (params/tiny_qwen4_exp_cpu.yaml: 2 ranks, meta init, each rank half
  of every n-gram table), and the SFT run's export, in which ``save_pretrained`` splits the tables into their parts.

The family's tests of the shared files run through ``EVERY_FAMILY`` (``test_chunked.py`` chunk = HF, loss
and every gradient, images and video, the router's aux loss; ``test_lora.py``, ``test_export.py``, ...).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_batch, over_families, tiny_checkpoint, tiny_processor
from data.test_packing import forward_backward, samples_of
from multiproc import free_port, scaled
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from qwenkit import cli, launch
from qwenkit.data import Collator
from qwenkit.engine.run import metrics
from qwenkit.model.families import ple
from qwenkit.model.families import registry as families

QWEN4 = over_families("qwen4_exp")
NEEDS_QWEN4 = pytest.mark.skipif(bool(why := families.get("qwen4_exp").unavailable()), reason=why or "")
IMAGES = (1, 0, 2, 1)  # samples of 20-80 tokens: past the indexer's 8-token budget, several PLE conv windows


def _packed_and_padded(processor, seed=1):
    samples = samples_of(processor, make_batch(processor, images_per_sample=IMAGES, seed=seed))
    return Collator(processor)(samples), Collator(processor, packing=True)(samples)


@QWEN4
def test_packed_equals_padded_loss_and_every_gradient(family, make_model, family_processor):
    """fp32; the router's aux loss off (it averages over the padded batch's attention mask, as for the other MoEs)."""
    padded, packed = _packed_and_padded(family_processor)
    model = make_model(chunk=True, seed=0)
    model.config.text_config.output_router_logits = False
    loss_padded, grads_padded = forward_backward(model, padded)
    loss_packed, grads_packed = forward_backward(model, packed)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-6)
    assert grads_packed.keys() == grads_padded.keys()
    assert any(".ple.ple_embedding." in n for n in grads_padded) and any("visual" in n for n in grads_padded)
    for name, g in grads_padded.items():  # vision tower, PLE tables and convs, hyper-connections, experts, head
        torch.testing.assert_close(grads_packed[name], g, rtol=1e-5, atol=1e-6, msg=name)
    ple.revert()  # HF's PLE on the packed row: the next sample's first n-grams and conv taps read the previous one
    try:
        leaked, _ = forward_backward(model, packed)
    finally:
        ple.install()
    assert not torch.allclose(leaked, loss_padded, rtol=1e-4, atol=0)


@QWEN4
def test_the_indexer_gets_no_gradient_from_hf_and_is_frozen(family, make_model, family_processor):
    stock = families.get(family).load("hf_class").from_pretrained(tiny_checkpoint(family))
    batch = make_batch(family_processor, images_per_sample=(1, 0), seed=2)
    stock(**batch).loss.backward()
    indexer = [n for n, p in stock.named_parameters() if ".self_attn.indexer." in n]
    assert indexer and all(stock.get_parameter(n).grad is None for n in indexer)
    ours = make_model(chunk=True)
    assert all(not ours.get_parameter(n).requires_grad for n in indexer)
    assert all(p.requires_grad for n, p in ours.named_parameters() if ".self_attn.indexer." not in n)


@NEEDS_QWEN4
@pytest.mark.parametrize(
    "overrides, says",
    [
        (["--nproc", "2", "parallel.sp_size=2"], "parallel.sp_size=2: qwen4_exp's indexed_attention layers cannot run sequence parallel"),
        (["model.attn_implementation=flash_attention_2"], "qwen4_exp's indexed_attention layers run with sdpa, eager"),
        (["--nproc", "2", "parallel.cpu_offload=true"],
         "parallel.cpu_offload=true: qwen4_exp's column-sharded tables (model.language_model.layers.*.ple.ple_embedding.ngram_embedding) stay outside FSDP2"),
    ],
)  # fmt: skip
def test_what_it_cannot_run_is_refused_before_start(overrides, says, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun must not start"))
    out = tmp_path / "run"
    flags = [o for o in overrides if o.startswith("--") or o.isdigit()]
    keys = [o for o in overrides if o not in flags]
    assert cli.main(["train", *flags, "model.name=qwen4_exp", "parallel.device=cpu", *keys, f"train.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert not out.exists()


def test_vllm_is_refused_by_the_entry():
    """(Through the launcher, an environment without vLLM refuses first: the entry's own line here.)"""
    from qwenkit import config as qconfig

    cfg = qconfig.load(overrides=["model.name=qwen4_exp", "train.objective=grpo"])
    object.__setattr__(cfg.grpo, "rollout_engine", "vllm")  # past the loader's own vLLM check
    (line,) = families.get("qwen4_exp").problems(cfg)
    assert line.startswith("grpo.rollout_engine=vllm: vLLM 0.32 has no qwen4_exp model") and line.endswith("use the hf engine")


@NEEDS_QWEN4
def test_template_is_qwen3_5s_with_its_thinking_block():
    tok = tiny_processor("qwen4_exp").tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], tokenize=False)
    assert "<think>\n\n</think>\n\nHello.<|im_end|>" in text


@NEEDS_QWEN4
def test_a_transformers_before_5_23_is_refused_naming_5_23(tmp_path, monkeypatch, capsys):
    """5.22 (faked: its version, the module left in place) has no qwen4_exp: the one line names the family's real
    minimum, not "5.x" (the refusal over every family, a missing module, is test_registry's)."""
    import importlib.metadata

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun must not start"))
    version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda p: "5.22.0" if p == "transformers" else version(p))
    out = tmp_path / "run"
    assert cli.main(["train", "model.name=qwen4_exp", f"train.output_dir={out}"]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "qwen4_exp" in line]
    assert "model.name=qwen4_exp needs transformers >= 5.23 (transformers.models.qwen4_exp)" in line, line
    assert "transformers 5.22.0 is installed" in line and not out.exists()


ROOT = Path(__file__).resolve().parents[3]
SMALL = ["train.steps=2", "train.warmup_steps=1", "train.micro_batch_size=2", "data.tiny_samples=16",
         "data.tiny_eval_samples=4", "train.eval_samples=2", "train.eval_every=0", "train.eval_accuracy_every=0",
         "parallel.allow_oversubscribe=true"]  # fmt: skip
# GRPO: a reward the random tiny model's completions differ by (exact match never happens: no gradient)
GRPO = ["grpo.rewards=[engine.objectives.test_grpo:vowels]", "grpo.num_generations=2", "grpo.max_new_tokens=6"]


@NEEDS_QWEN4
@pytest.mark.slow
@pytest.mark.parametrize("objective, extra", [("sft", ["checkpoint.every=0"]), ("dpo", []), ("grpo", GRPO)])
def test_each_objective_trains_through_qwenkit_train_with_the_tables_sharded(objective, extra, tmp_path):
    """2 ranks, meta init: each rank reads its columns of the tables' checkpoint parts; two steps, the same loss and
    grad norm on both ranks (one reduced gradient), finite and moving. SFT's checkpoint exports to a directory
    that HF's class loads, the tables split into their parts again, each part the checkpoint's rows."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    run = [sys.executable, "-m", "qwenkit.cli", "train", "--config", "params/tiny_qwen4_exp_cpu.yaml", "--master-port",
           str(free_port()), *SMALL, f"train.objective={objective}", *extra, f"train.output_dir={out}"]  # fmt: skip
    proc = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (out / "logs" / "rank-00000.log").read_text()
    assert "column-sharded tables: 2, " in log and "meta init:" in log
    rows = metrics.read(out)
    for name in ("loss", "grad_norm"):
        by_rank = [metrics.series(rows, name, r) for r in (0, 1)]
        assert sorted(by_rank[0]) == [1, 2] and by_rank[0] == by_rank[1], name
        assert all(math.isfinite(v) for v in by_rank[0].values()), by_rank
    assert all(v > 0 for v in metrics.series(rows, "grad_norm").values())
    if objective == "grpo":
        assert "in step: the column-sharded tables stay split, each lookup a collective" in log
    if objective != "sft":
        return
    hf = tmp_path / "hf"
    exported = subprocess.run([sys.executable, "-m", "qwenkit.cli", "export", str(out), str(hf)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=scaled(300))  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    loaded = families.get("qwen4_exp").load("hf_class").from_pretrained(hf)
    parts = {}
    for file in hf.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            parts.update({k: f.get_tensor(k) for k in f.keys() if ".ngram_embedding." in k})
    tables = {n: p for n, p in loaded.named_parameters() if n.endswith(".ngram_embedding.weight")}
    assert len(tables) == 2 and not parts.keys() & tables.keys()  # on disk in parts only, as HF writes them
    dcp_to_torch_save(str(out / "checkpoints" / "step-00000002"), str(tmp_path / "trained.pt"))
    trained = torch.load(tmp_path / "trained.pt", weights_only=False)["model"]
    with safe_open(str(next(tiny_checkpoint("qwen4_exp").glob("*.safetensors"))), framework="pt") as f:
        start = {k: f.get_tensor(k) for k in f.keys() if ".ngram_embedding." in k}
    for name, table in tables.items():
        stem = name.removesuffix(".weight")
        keys = [f"{stem}.shard_{i}.weight" for i in range(loaded.config.text_config.split_ngram_parts)]
        torch.testing.assert_close(torch.cat([parts[k] for k in keys]), trained[name], rtol=0, atol=0)
        torch.testing.assert_close(table.detach(), trained[name], rtol=0, atol=0)
        assert not torch.equal(torch.cat([start[k] for k in keys]), trained[name])  # trained: the rows looked up moved


@NEEDS_QWEN4
def test_the_memory_table_in_performance_md_is_the_scripts_output(capsys):
    """docs/PERFORMANCE.md's Qwen4-Exp table is what benchmarks/qwen4_exp_memory.py prints (not typed by hand)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import qwen4_exp_memory
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    qwen4_exp_memory.main([])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    doc = (ROOT / "docs" / "PERFORMANCE.md").read_text()
    section = doc[doc.index("## Qwen4-Exp on 8, 16 and 32 GPUs") :]
    documented = [line for line in section[: section.index("\n## ", 3)].splitlines() if line.startswith("| ")]
    assert len(printed) == 4 and documented == printed
