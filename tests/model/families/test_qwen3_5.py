"""Qwen3.5 (dense and MoE) against transformers' own Qwen3.5 code.

- packed rows: :mod:`qwenkit.model.families.linear_attention`'s causal conv1d and gated delta rule on a
  packed row equal HF's own PyTorch fallbacks run on each sample alone (outputs and input
  gradients), with sample boundaries inside the conv window and a sample longer than one
  64-token chunk; the same inputs through HF's fallback without boundaries differ (a leak shows);
  loss and gradients of whole packed rows are in ``test_packing.py``;
- tokens: the family's chat template through HF's ``apply_chat_template`` (the thinking block);
- ``generate`` of the subclass equals HF's class; LoRA's ``all-linear`` reaches the
  linear-attention projections;
- refused before any process starts: linear-attention heads that ``parallel.sp_size`` does not
  divide, and a transformers without Qwen3.5 (4.57). Sequence parallelism's equality with one
  process is in ``test_sequence_parallel.py``.

The Qwen3.5 tests of the shared files run through ``EVERY_FAMILY`` (``test_model.py`` chunk = HF for
text, image, video, tied, MoE aux loss; ``test_lora.py``, ``test_export.py``, ``test_preference_train.py``).
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from conftest import hf_reference_ids, make_cfg, over_families, runs, tiny_checkpoint, tiny_processor
from engine.generation.test_generate import _generate, _prompt

from qwenkit import cli, launch
from qwenkit.data import read_dataset
from qwenkit.model.families import linear_attention as la
from qwenkit.model.families import registry as families
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX

NEEDS_QWEN3_5 = pytest.mark.skipif(bool(families.get("qwen3_5").unavailable()), reason="transformers 4.57 has no Qwen3.5")

LENGTHS = (5, 2, 70, 3)  # a 2-token sample inside the 4-wide conv window; 70 > one 64-token chunk
TIGHT = dict(rtol=1e-5, atol=1e-6)  # fp32; the per-sample runs pad to other chunk counts (other GEMM shapes)


def _hf():
    la.install()  # what building the subclass does
    return importlib.import_module(la.MODULES[0])


def _streams(seed=0):
    """A packed row's conv input ``[1, C, T]`` and delta-rule inputs ``[1, T, heads, dim]``, with grads."""
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    conv = (torch.randn(1, 12, total, generator=g), torch.randn(12, 4, generator=g) * 0.5)
    q, k = (torch.randn(1, total, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, total, 4, 8, generator=g)  # two value heads per key head
    decay = -torch.rand(1, total, 4, generator=g)  # log decay <= 0
    beta = torch.rand(1, total, 4, generator=g)
    tensors = [*conv, q, k, v, decay, beta]
    return [t.requires_grad_() for t in tensors]


def _cu():
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


def _packed(module, x, w, q, k, v, decay, beta):
    cu = _cu()
    conv = module.causal_conv1d_fn(x, w, None, activation="silu", cu_seq_lens_q=cu)
    out, _ = module.torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return conv, out


def _per_sample(module, x, w, q, k, v, decay, beta):
    """HF's own PyTorch fallbacks, one sample at a time."""
    conv_fn, delta_fn = la._fallback(module, la.CONV), la._fallback(module, la.DELTA)
    convs, outs, cu = [], [], _cu().tolist()
    for a, b in zip(cu, cu[1:]):
        convs.append(conv_fn(x[..., a:b], w, None, activation="silu"))
        outs.append(delta_fn(q[:, a:b], k[:, a:b], v[:, a:b], g=decay[:, a:b], beta=beta[:, a:b], use_qk_l2norm_in_kernel=True)[0])
    return torch.cat(convs, dim=-1), torch.cat(outs, dim=1)


def _grads(outputs, inputs):
    loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outputs)  # every position weighs
    return torch.autograd.grad(loss, inputs)


@NEEDS_QWEN3_5
def test_varlen_path_equals_per_sample_runs_of_hfs_fallback():
    module = _hf()
    inputs = _streams()
    got, want = _packed(module, *inputs), _per_sample(module, *inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TIGHT)
    for name, a, b in zip(("x", "w", "q", "k", "v", "g", "beta"), _grads(got, inputs), _grads(want, inputs)):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, n=name: f"d{n}: {m}")


@NEEDS_QWEN3_5
def test_the_reference_sees_a_leak():
    """HF's fallback on the packed row without boundaries (positions reset alone): the conv window and
    the state run into the next sample, and the comparison above would fail by far more than its tolerance."""
    module = _hf()
    x, w, q, k, v, decay, beta = _streams()
    leaked_conv = la._fallback(module, la.CONV)(x, w, None, activation="silu")
    leaked, _ = la._fallback(module, la.DELTA)(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    conv, out = _per_sample(module, x, w, q, k, v, decay, beta)
    second = slice(LENGTHS[0], LENGTHS[0] + LENGTHS[1])  # the 2-token sample: inside the first one's window
    assert (leaked_conv[..., second] - conv[..., second]).abs().max() > 1e-2
    assert (leaked[:, LENGTHS[0]:] - out[:, LENGTHS[0]:]).abs().max() > 1e-2


@NEEDS_QWEN3_5
def test_unpacked_calls_are_hfs_own():
    """Without boundaries the installed functions are HF's: same result as HF's function, bit for bit."""
    module = _hf()
    x, w, q, k, v, decay, beta = (t.detach() for t in _streams(seed=1))
    torch.testing.assert_close(module.causal_conv1d_fn(x, w, None, activation="silu"),
                               la._originals[(module.__name__, la.CONV)](x, w, None, activation="silu"), rtol=0, atol=0)  # fmt: skip
    got, _ = module.torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    want, _ = la._originals[(module.__name__, la.DELTA)](q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.cuda
@NEEDS_QWEN3_5
def test_cuda_kernels_keep_samples_apart():
    """causal-conv1d (seq_idx) and flash-linear-attention (cu_seqlens) on CUDA equal the per-sample fallback."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("causal_conv1d")
    pytest.importorskip("fla")
    module = _hf()
    inputs = [t.detach().cuda().requires_grad_() for t in _streams()]
    got, want = _packed(module, *inputs), _per_sample(module, *inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)  # tf32 / the kernels' own summation order


# ---------------------------------------------------------------------------------------------
# Data, generation, LoRA


@NEEDS_QWEN3_5
def test_template_equals_hf_chat_template_with_its_thinking_block(tmp_path):
    """The replies after the last user turn open with the thinking block (empty: not learned; a
    reply's own reasoning: learned with it); earlier replies keep their answer only."""
    processor = tiny_processor("qwen3_5")
    rows = [
        {"messages": [{"role": "user", "content": "What is this?"}, {"role": "assistant", "content": "A square."}]},
        {"messages": [{"role": "user", "content": "Shape?"}, {"role": "assistant", "content": "<think>\nIt has corners.\n</think>\n\nA square."},
                      {"role": "user", "content": "Colour?"}, {"role": "assistant", "content": "<think>\nRed pixels.\n</think>\n\nRed."}]},  # fmt: skip
    ]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    dataset, report = read_dataset(make_cfg(path=str(tmp_path / "d.json"), shuffle=False).data, processor)
    assert (len(dataset), report.skipped) == (2, 0)
    tok = processor.tokenizer
    for i, row in enumerate(rows):
        assert dataset[i]["input_ids"].tolist() == hf_reference_ids(processor, row, []), i
    learned = [[tok.decode(dataset[i]["labels"][s:e]) for s, e in runs(dataset[i]["labels"] != IGNORE_INDEX)] for i in (0, 1)]
    assert "<think>\n\n</think>\n\n" in tok.decode(dataset[0]["input_ids"])
    assert learned[0] == ["A square.<|im_end|>"]  # the empty block is the prompt's
    assert learned[1] == ["A square.<|im_end|>", "<think>\nRed pixels.\n</think>\n\nRed.<|im_end|>"]
    assert tok.convert_tokens_to_ids("<think>") != tok.unk_token_id and len(tok.encode("<think>")) == 1


@over_families("qwen3_5", "qwen3_5_moe")
def test_generate_equals_hf(family, make_model, batch_factory):
    ours = make_model(chunk=False, seed=7).eval()
    stock = families.get(family).load("hf_class").from_pretrained(tiny_checkpoint(family)).eval()
    stock.load_state_dict(ours.state_dict())
    prompt = _prompt(batch_factory(images_per_sample=(1,), seed=3))
    assert torch.equal(_generate(ours, **prompt), _generate(stock, **prompt))


@NEEDS_QWEN3_5
def test_all_linear_lora_adapts_the_linear_attention_projections():
    pytest.importorskip("peft")
    from qwenkit import config as qconfig
    from qwenkit.model import lora
    from qwenkit.model.families import build as registry

    cfg = qconfig.load(overrides=["model.name=qwen3_5_moe", "lora.r=4", "lora.target_modules=all-linear"])
    model = registry.build(cfg.model, cfg.loss)
    targets, problems = lora.target_problems(model, cfg.lora)
    assert not problems
    layer0 = {t.rsplit(".", 1)[-1] for t in targets if ".layers.0." in t}
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"} <= layer0
    assert not any(t.endswith((".mlp.gate", ".shared_expert_gate")) for t in targets)  # routing is never adapted


# ---------------------------------------------------------------------------------------------
# Refusals before start


@NEEDS_QWEN3_5
def test_linear_attention_heads_that_do_not_split_are_refused_before_start(tmp_path, monkeypatch, capsys):
    """sp_size=4: the tiny model's 4 attention heads split, its 2 linear-attention key heads do not."""
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun must not start"))
    out = tmp_path / "run"
    assert cli.main(["train", "--nproc", "4", "model.name=qwen3_5", "parallel.sp_size=4", "parallel.device=cpu",
                     f"train.output_dir={out}"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "parallel.sp_size=4 must divide text_config.linear_num_key_heads=2" in err and "Traceback" not in err
    assert not out.exists()


@over_families("qwen3_5", "qwen3_5_moe")
def test_export_carries_the_base_checkpoints_mtp_tensors_unchanged(family, tmp_path, caplog):
    """The tiny checkpoint ships an MTP layer (``mtp.*``, as Qwen3.5 checkpoints do, in a dtype of its own
    here): one training step, then the export holds those tensors bit for bit, indexed, and HF's class
    loads the export; a base without them exports without them."""
    import logging
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from qwenkit import config as qconfig
    from qwenkit.engine.checkpoints import export as hf_export
    from qwenkit.engine.run import train

    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint(family), base)
    weights = load_file(base / "model.safetensors")
    mtp = {k: v for k, v in weights.items() if k.startswith("mtp.")}
    assert families.get(family).mtp_layers == 1 and "mtp.fc.weight" in mtp and any(".self_attn." in k for k in mtp)
    mtp["mtp.norm.weight"] = mtp["mtp.norm.weight"].to(torch.bfloat16)  # kept as it is, not cast to the model's
    save_file(weights | mtp, base / "model.safetensors", metadata={"format": "pt"})
    run = tmp_path / "run"
    cfg = qconfig.load(overrides=[f"model.path={base}", f"model.name={family}", "train.steps=1", "data.tiny_samples=4",
                                  "train.micro_batch_size=2", "train.resume=none", "train.warmup_steps=1",
                                  "train.eval_samples=0", f"train.output_dir={run}"])  # fmt: skip
    train.run(cfg)
    with caplog.at_level(logging.INFO, logger="qwenkit.engine.checkpoints.export"):
        exported = hf_export.export(run, tmp_path / "hf", cfg)
    assert f"keeps the base model's multi-token-prediction layer: {len(mtp)} mtp.* tensors" in caplog.text
    index = json.loads((exported / hf_export.INDEX).read_text())["weight_map"]
    assert {k for k in index if k.startswith("mtp.")} == set(mtp)
    for key, value in mtp.items():
        with safe_open(exported / index[key], framework="pt") as f:
            assert torch.equal(f.get_tensor(key), value) and f.get_tensor(key).dtype == value.dtype
    assert all((exported / f).is_file() for f in set(index.values()))
    model = families.get(family).load("hf_class").from_pretrained(exported)
    trained = {k: v for k, v in load_file(exported / "model.safetensors").items()}
    for key, value in model.state_dict().items():
        if key in trained:
            torch.testing.assert_close(value, trained[key], rtol=0, atol=0)
    save_file({k: v for k, v in weights.items() if k not in mtp}, base / "model.safetensors", metadata={"format": "pt"})
    assert hf_export.keep_mtp(base, tmp_path) == 0 and not (tmp_path / hf_export.MTP_FILE).exists()
