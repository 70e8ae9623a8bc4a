"""Qwen4-Exp against transformers' own Qwen4-Exp code (transformers >= 5.23; skipped where it is missing).

- packed rows: loss and every gradient of a packed row equal the padded batch's (DeltaNet's conv and state,
  the QSA indexer's compressed blocks, PLE's n-grams and dilated conv all restart at each sample); with
  HF's PLE forward put back (:func:`qwenkit.model.families.ple.revert`) the packed row differs (the leak shows);
- the QSA indexer: HF's forward gives its weights no gradient (a top-k selection), so the entry freezes it;
- refused before any process starts: sequence parallelism (the indexer's blocks), flash attention,
  vLLM rollouts, and a transformers without ``qwen4_exp``.

The family's tests of the shared files run through ``EVERY_FAMILY`` (``test_chunked.py`` chunk = HF, loss
and every gradient, images and video, the router's aux loss; ``test_lora.py``, ``test_export.py``, ...).
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch, over_families, tiny_checkpoint, tiny_processor
from data.test_packing import forward_backward, samples_of

from qwenkit import cli, launch
from qwenkit.data import Collator
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
