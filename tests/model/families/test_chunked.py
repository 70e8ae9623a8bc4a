"""Chunk mode vs HF's own forward on each family's tiny model: loss and every parameter's gradient.

Tests marked ``EVERY_FAMILY`` run for Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE (the
MoE tiny configs have the router's auxiliary loss on, so the equality includes it as HF adds it).
"""

import inspect

import pytest
import torch
from conftest import AUDIO_FAMILY, EVERY_FAMILY, FAMILIES, make_batch, over_families

from qwenkit import config as qconfig
from qwenkit.bench.step import loss_and_grads
from qwenkit.model.families import build as registry
from qwenkit.model.families import chunked
from qwenkit.model.families import registry as families
from qwenkit.model.losses.cross_entropy import shift_labels

# fp32 on both sides; the chunked head sums in another order, so allow a few ulps of the sums.
FP32 = dict(rtol=1e-5, atol=1e-7)
# Qwen3.5's Gated DeltaNet layers solve a triangular system per 64-token chunk (fp32, HF's fallback):
# the head's few-ulp differences in d(hidden) come out of four such layers up to ~2e-7 absolute in the
# embedding gradient (2 of 28,672 elements above 1e-7 measured); a wrong term moves them by orders more.
HYBRID_FP32 = dict(rtol=1e-5, atol=1e-6)


def _pair(make_model, seed=1, **kw):
    """Two identical tiny models (random weights, not the near-uniform init), HF head and chunked."""
    return make_model(chunk=False, seed=seed, **kw), make_model(chunk=True, seed=seed, **kw)


def _assert_same(a, b, tol=None):
    (la, ga), (lb, gb) = a, b
    if tol is None:
        tol = HYBRID_FP32 if any(".linear_attn." in name for name in ga) else FP32
    torch.testing.assert_close(la, lb, **tol)
    assert ga.keys() == gb.keys()
    for name in ga:
        if ga[name] is None or gb[name] is None:  # e.g. the vision tower on a text-only batch
            assert ga[name] is gb[name] is None, name
            continue
        torch.testing.assert_close(ga[name], gb[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def _video_batch(processor, family="qwen2_5_vl", seed=0):
    """One text+video sample built from tensors: t=2, h=w=4 patches -> 8 video tokens.

    Qwen2.5-VL: one ``<vision_start> pads <vision_end>`` span; Qwen3-VL (``video_timestamps``):
    one span per temporal patch, each after its timestamp text (random tokens here).
    """
    g = torch.Generator().manual_seed(seed)
    ip = processor.image_processor
    width = 3 * ip.temporal_patch_size * ip.patch_size**2  # 1176 (14-px patches), 1536 (16-px)
    grid = torch.tensor([[2, 4, 4]])
    n_tok = int(grid.prod()) // 4
    text = torch.randint(0, 300, (12,), generator=g).tolist()
    spans = 2 if families.get(family).video_timestamps else 1
    ids, labels, types = text[:5], [-100] * 5, [0] * 5
    for k in range(spans):
        stamp = text[5 + k : 6 + k] if spans > 1 else []  # "<t seconds>" before each frame group
        span = [processor.vision_start_id] + [processor.video_token_id] * (n_tok // spans) + [processor.vision_end_id]
        ids += stamp + span
        labels += [-100] * (len(stamp) + len(span))
        types += [0] * (len(stamp) + 1) + [2] * (n_tok // spans) + [0]
    ids += text[5:]
    labels += text[5:]
    types += [0] * (len(text) - 5)
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "labels": torch.tensor([labels]),
        "mm_token_type_ids": torch.tensor([types], dtype=torch.int),
        "pixel_values_videos": torch.randn(int(grid.prod()), width, generator=g),
        "video_grid_thw": grid,
    } | ({} if spans > 1 else {"second_per_grid_ts": torch.tensor([1.0])})  # Qwen3-VL: timestamps instead


@EVERY_FAMILY
@pytest.mark.parametrize(
    "images, chunk_size",
    [
        ((0, 0), 7),  # text only, chunk does not divide
        ((1, 0, 2), 16),  # image-text
        ((1, 2), 1024),  # chunk exceeds the sequence
        ((1, 1), "auto"),
    ],
)
def test_chunk_equals_hf_loss_and_every_grad(make_model, batch_factory, images, chunk_size):
    hf, ours = _pair(make_model)
    ours.configure_loss(chunk=True, chunk_size=chunk_size)
    batch = batch_factory(images_per_sample=images)
    _assert_same(loss_and_grads(hf, batch), loss_and_grads(ours, batch))


def test_chunk_size_that_divides_the_sequence(make_model, batch_factory):
    batch = batch_factory(images_per_sample=(1, 1), seq_len=64)  # 2 x 64 tokens, chunks of 32
    hf, ours = _pair(make_model)
    ours.configure_loss(chunk=True, chunk_size=32)
    _assert_same(loss_and_grads(hf, batch), loss_and_grads(ours, batch))


def _audio_batch(processor, family, model, frames=(300, 173), images=(0, 0), seed=0):
    """``make_batch``'s rows, each after one ``<audio_start> pads <audio_end>`` span of ``frames[b]``
    random 128-bin mel frames (0: no audio in that row), right-padded again. A span holds the audio
    tower's output length (``model.audio_tokens``; a wrong count is refused by HF's placeholder check):
    300 frames -> 75 tokens, 173 -> 44 (Qwen2.5-Omni); 39 and 23 (Qwen3-Omni)."""
    base = make_batch(processor, images_per_sample=images, seed=seed)
    start, pad, end = processor.tokenizer.convert_tokens_to_ids(list(families.get(family).audio_tokens))
    rows = []
    for b, n in enumerate(frames):
        keep = base["attention_mask"][b].bool()
        tokens = int(model.audio_tokens(torch.tensor([n]))) if n else 0
        span = [start] + [pad] * tokens + [end] if n else []
        rows.append((span + base["input_ids"][b][keep].tolist(), [-100] * len(span) + base["labels"][b][keep].tolist()))
    width = max(len(ids) for ids, _ in rows)
    batch = {k: v for k, v in base.items() if k in ("pixel_values", "image_grid_thw")}
    batch["input_ids"] = torch.full((len(rows), width), processor.pad_token_id)
    batch["attention_mask"] = torch.zeros(len(rows), width, dtype=torch.long)
    batch["labels"] = torch.full((len(rows), width), -100)
    for b, (ids, labels) in enumerate(rows):
        batch["input_ids"][b, : len(ids)], batch["labels"][b, : len(ids)] = torch.tensor(ids), torch.tensor(labels)
        batch["attention_mask"][b, : len(ids)] = 1
    heard = [n for n in frames if n]
    if heard:
        g = torch.Generator().manual_seed(seed)
        batch["input_features"] = torch.randn(len(heard), 128, max(heard), generator=g)
        batch["feature_attention_mask"] = (torch.arange(max(heard)) < torch.tensor(heard)[:, None]).long()
    return batch


@AUDIO_FAMILY
@pytest.mark.parametrize(
    "frames, images, chunk_size",
    [
        ((300, 173), (0, 0), 16),  # audio-text, two lengths: the tower's windows of 2 * n_window frames
        ((300, 0), (1, 2), 7),  # audio, images, and a row without audio
        ((0, 0), (1, 0), "auto"),  # no audio in the batch
    ],
)
def test_audio_chunk_equals_hf_loss_and_every_grad(make_model, family_processor, family, frames, images, chunk_size):
    hf, ours = _pair(make_model)
    ours.configure_loss(chunk=True, chunk_size=chunk_size)
    batch = _audio_batch(family_processor, family, ours, frames, images)
    reference, (loss, grads) = loss_and_grads(hf, batch), loss_and_grads(ours, batch)
    _assert_same(reference, (loss, grads))
    audio = [n for n, _ in ours.named_parameters() if n.startswith("model.audio_tower")]
    assert len(audio) > 10
    for name in audio:  # a gradient (nonzero) for every audio parameter that heard something, else none
        heard = any(frames) and "audio_bos_eos_token" not in name  # HF's tower never uses that embedding
        assert (name in grads and bool(grads[name].abs().sum() > 0)) == heard, name


@EVERY_FAMILY
def test_vision_gradients_are_compared_and_nonzero(make_model, batch_factory):
    hf, ours = _pair(make_model)
    batch = batch_factory(images_per_sample=(1, 2))
    _, grads = loss_and_grads(ours, batch)
    _assert_same(loss_and_grads(hf, batch), (_, grads))
    vision = {n: g for n, g in grads.items() if n.startswith("model.visual")}
    assert len(vision) > 10
    for name, g in vision.items():
        assert torch.isfinite(g).all() and g.abs().sum() > 0, name


@EVERY_FAMILY
def test_video_batch(make_model, family_processor, family):
    hf, ours = _pair(make_model)
    batch = _video_batch(family_processor, family)
    _assert_same(loss_and_grads(hf, batch), loss_and_grads(ours, batch))


@EVERY_FAMILY
@pytest.mark.parametrize("loss_type", ["token_mean", "sample_mean"])
def test_reductions_match_the_full_logits_head(make_model, batch_factory, loss_type):
    hf, ours = _pair(make_model)
    hf.configure_loss(chunk=False, loss_type=loss_type)
    ours.configure_loss(chunk=True, loss_type=loss_type, chunk_size=9)
    batch = batch_factory(images_per_sample=(1, 0, 2))
    _assert_same(loss_and_grads(hf, batch), loss_and_grads(ours, batch))


@pytest.mark.parametrize("loss_type", ["token_mean", "sample_mean"])
def test_shift_labels_are_used_as_given(make_model, batch_factory, loss_type):
    """Pre-shifted labels (sequence parallelism passes them) replace the shift of ``labels``,
    as in HF's ForCausalLMLoss; the chunked head gives HF's loss and gradients for each."""
    hf, ours = _pair(make_model)
    hf.configure_loss(chunk=False, loss_type=loss_type)
    ours.configure_loss(chunk=True, loss_type=loss_type, chunk_size=11)
    batch = batch_factory(images_per_sample=(1, 0))
    plain = shift_labels(batch["labels"]).contiguous()  # HF views it flat
    g = torch.Generator().manual_seed(0)
    variants = [
        plain,
        torch.where(torch.rand(plain.shape, generator=g) < 0.5, -100, plain),  # fewer learned tokens
        torch.where(plain != -100, torch.randint(0, 300, plain.shape, generator=g), plain),  # other targets
    ]
    losses = []
    for shifted in variants:
        with_shift = {**batch, "shift_labels": shifted}
        want, got = loss_and_grads(hf, with_shift), loss_and_grads(ours, with_shift)
        _assert_same(want, got)
        losses.append(got[0].item())
    assert len(set(losses)) == 3  # each set of shifted labels is what the loss used


@EVERY_FAMILY
def test_non_chunk_mode_is_hf_forward(make_model, batch_factory, family_path, family):
    ours = make_model(chunk=False)
    stock = families.get(family).load("hf_class").from_pretrained(family_path)
    batch = batch_factory(images_per_sample=(1, 0))
    a = ours(**batch)
    b = stock(**batch)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=0)
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)
    kw = {k: v for k, v in batch.items() if k != "labels"}
    last = ours(**kw, logits_to_keep=1, use_cache=True)
    # HF's Omni thinkers take no logits_to_keep (it reaches **kwargs): all positions, as HF's forward gives
    kept = 1 if "logits_to_keep" in inspect.signature(type(stock).forward).parameters else b.logits.shape[1]
    assert last.logits.shape[1] == kept
    torch.testing.assert_close(last.logits, b.logits[:, -kept:], **FP32)


@EVERY_FAMILY
def test_chunk_with_recompute(make_model, batch_factory):
    hf, ours = _pair(make_model)
    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ours.train()
    hf.train()
    batch = batch_factory(images_per_sample=(1, 1))
    _assert_same(loss_and_grads(hf, batch), loss_and_grads(ours, batch))


@EVERY_FAMILY
def test_frozen_vision_tower_gets_no_grads(batch_factory, family):
    cfg = qconfig.load(overrides=["model.freeze=[model.visual]", f"model.name={family}"])
    model = registry.build(cfg.model, cfg.loss)
    _, grads = loss_and_grads(model, batch_factory(images_per_sample=(1, 1)))
    assert not any(n.startswith("model.visual") for n in grads)
    assert all(p.grad is None for p in model.model.visual.parameters())
    counts = registry.parameter_counts(model)
    assert counts["vision blocks"]["trainable"] == counts["merger"]["trainable"] == 0
    assert counts["language model"]["trainable"] == counts["language model"]["total"] > 0


def test_freeze_unknown_path_names_it():
    cfg = qconfig.load(overrides=["model.freeze=[model.vision]"])
    with pytest.raises(ValueError, match="model.freeze: no module 'model.vision'"):
        registry.build(cfg.model, cfg.loss)


def test_sdpa_and_eager_agree(make_model, batch_factory):
    batch = batch_factory(images_per_sample=(1, 2))
    sdpa = make_model(chunk=True, seed=2)
    eager = make_model(chunk=True, seed=2, attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    _assert_same(loss_and_grads(sdpa, batch), loss_and_grads(eager, batch), tol=dict(rtol=1e-4, atol=1e-6))


@EVERY_FAMILY
def test_tuple_output(make_model, batch_factory):
    ours = make_model(chunk=True, seed=1)
    batch = batch_factory(images_per_sample=(1,))
    out = ours(**batch, return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], ours(**batch).loss)


@EVERY_FAMILY
def test_tied_embeddings_in_both_modes(make_model, batch_factory):
    hf, ours = _pair(make_model, tie_word_embeddings=True)
    assert ours.lm_head.weight is ours.model.language_model.embed_tokens.weight
    assert isinstance(ours.lm_head, chunked.ChunkedLMHead)
    batch = batch_factory(images_per_sample=(1, 0))
    _assert_same(loss_and_grads(hf, batch), loss_and_grads(ours, batch))


@EVERY_FAMILY
@pytest.mark.parametrize(
    "kwargs, setup, pattern",
    [
        ({"labels": None}, {}, "chunk loss needs labels"),
        ({"use_cache": True}, {}, "use_cache=False"),
        ({"logits_to_keep": 1}, {}, "logits_to_keep=0"),
        ({}, {"loss_type": "raw"}, "'raw'"),
    ],
)
def test_illegal_chunk_calls_raise_before_any_compute(make_model, batch_factory, kwargs, setup, pattern):
    ours = make_model(chunk=True)
    ours.configure_loss(chunk=True, **setup)

    def boom(*_):
        raise AssertionError("the backbone ran before the guard")

    ours.model.register_forward_pre_hook(boom)
    batch = {**batch_factory(images_per_sample=(1,)), **kwargs}
    with pytest.raises(ValueError, match=pattern):
        ours(**batch)


def test_token_mean_same_for_1x4_2x2_4x1(make_model, batch_factory):
    """Gradient accumulation / data parallelism: pass the global count, get the big batch."""
    batch = batch_factory(images_per_sample=(1, 0, 2, 1), seed=5)
    total = (batch["labels"][:, 1:] != -100).sum()
    results = []
    for parts in (1, 2, 4):
        model = make_model(chunk=True, seed=3)
        model.configure_loss(chunk=True, chunk_size=13)
        model.zero_grad()
        loss_sum = 0.0
        for i in range(parts):
            rows = slice(i * 4 // parts, (i + 1) * 4 // parts)
            sub = {k: batch[k][rows] for k in ("input_ids", "attention_mask", "labels", "mm_token_type_ids")}
            grids = batch["image_grid_thw"]
            per_sample = [int((batch["input_ids"][r] == model.config.vision_start_token_id).sum()) for r in range(4)]
            first = sum(per_sample[: rows.start])
            count = sum(per_sample[rows])
            if count:
                sub["image_grid_thw"] = grids[first : first + count]
                start = int(grids[:first].prod(-1).sum())
                sub["pixel_values"] = batch["pixel_values"][start : start + int(sub["image_grid_thw"].prod(-1).sum())]
            loss = model(**sub, num_items_in_batch=total).loss
            loss.backward()
            loss_sum = loss_sum + loss.detach()
        results.append((loss_sum, {n: p.grad.clone() for n, p in model.named_parameters()}))
    for other in results[1:]:
        _assert_same(results[0], other)


def test_30_step_adamw_tracks_hf(make_model, batch_factory):
    """Same seed, same batches: chunk-mode training follows the HF-loss run step for step."""
    batches = [batch_factory(images_per_sample=(1, 0, 1), seed=s) for s in range(3)]
    curves = []
    for chunk in (False, True):
        torch.manual_seed(42)
        model = make_model(chunk=chunk)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        losses = []
        for step in range(30):
            opt.zero_grad()
            loss = model(**batches[step % 3]).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    hf, ours = curves
    assert max(abs(a - b) for a, b in zip(hf, ours)) <= 1e-5
    assert sum(ours[-3:]) < 0.8 * sum(ours[:3])


@pytest.mark.parametrize("frac, tie", [(0.0, False), (0.5, True), (0.9, False), (1.0, False)])
def test_skipping_head_equals_hf_at_ignored_fractions(make_model, batch_factory, frac, tie):
    """Image tokens and a share of the text ignored; the global normaliser makes 100% well defined."""
    hf, ours = _pair(make_model, tie_word_embeddings=tie)
    ours.configure_loss(chunk=True, chunk_size=5)
    batch = batch_factory(images_per_sample=(1, 0, 2), seed=4)
    labels = batch["input_ids"].clone()  # 0%: every position, image tokens included
    g = torch.Generator().manual_seed(9)
    if frac:
        labels[batch["mm_token_type_ids"] != 0] = -100
        labels[torch.rand(labels.shape, generator=g) < frac] = -100
    if frac >= 1:
        labels[:] = -100
    batch["labels"] = labels
    kw = {"num_items_in_batch": torch.tensor(int((labels[:, 1:] != -100).sum()) + 3)}
    _assert_same(loss_and_grads(hf, batch, **kw), loss_and_grads(ours, batch, **kw))


def test_head_bias_goes_into_the_chunk_loss():
    """A checkpoint whose lm_head has a bias: the chunked head equals F.linear + HF's loss, bias grad too."""
    from functools import partial

    from transformers.loss.loss_utils import ForCausalLMLoss

    from qwenkit.model.losses.cross_entropy import chunked_linear_cross_entropy

    torch.manual_seed(0)
    head = chunked.ChunkedLMHead(24, 97, bias=True)
    hidden = torch.randn(2, 11, 24, requires_grad=True)
    labels = torch.randint(0, 97, (2, 11))
    labels[:, :4] = -100
    ref = ForCausalLMLoss(head(hidden), labels, vocab_size=97)
    ref_grads = torch.autograd.grad(ref, (hidden, head.weight, head.bias))
    got = head(hidden, labels=labels, loss_fn=partial(chunked_linear_cross_entropy, chunk_size=4))
    torch.testing.assert_close(got, ref, **FP32)
    for a, b in zip(torch.autograd.grad(got, (hidden, head.weight, head.bias)), ref_grads):
        torch.testing.assert_close(a, b, **FP32)


def test_activation_offload_leaves_the_head_gradients_on_device(make_model, batch_factory, monkeypatch):
    """parallel.activation_offload's save_on_cpu packs the backbone's activations, never the head's
    finished fp32 grad W [V, H] (grad h [N, H] has the shape of backbone activations here; test_loss
    checks it)."""
    from qwenkit.distributed import fsdp

    packed = []

    class Counting(torch.autograd.graph.save_on_cpu):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory, device_type)
            inner = self.pack_hook

            def pack(t):
                packed.append(tuple(t.shape))
                return inner(t)

            self.pack_hook = pack

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    ours = make_model(chunk=True, seed=1)
    batch = batch_factory(images_per_sample=(1, 0))
    with fsdp.activation_offload(True, torch.device("cpu")):
        loss = ours(**batch).loss
    loss.backward()
    assert packed, "activation offload packed nothing: the probe is broken"
    assert tuple(ours.lm_head.weight.shape) not in packed, packed


def test_loss_under_no_grad_equals_the_training_loss(make_model, batch_factory):
    ours = make_model(chunk=True, seed=1)
    batch = batch_factory(images_per_sample=(1, 2))
    with torch.no_grad():
        evaluated = ours(**batch).loss
    assert evaluated.grad_fn is None
    torch.testing.assert_close(evaluated, ours(**batch).loss.detach(), rtol=0, atol=0)


@EVERY_FAMILY
@pytest.mark.parametrize("hidden_states", [False, True])
def test_tuple_output_keeps_hfs_positions_in_chunk_mode(make_model, batch_factory, hidden_states, family):
    if family != "qwen2_5_vl" and not chunked.ChunkLossMixin.takes_token_types(make_model(chunk=True)):
        pytest.skip("transformers 4.57's Qwen3-VL tuples order/fill hidden states differently: not matched yet")
    hf, ours = _pair(make_model)
    batch = batch_factory(images_per_sample=(1, 0))
    kw = dict(return_dict=False, use_cache=False, output_hidden_states=hidden_states)
    want, got = hf(**batch, **kw), ours(**batch, **kw)
    # HF's logits sit at index 1, or 2 after a MoE's aux_loss: where the dict output puts them
    at = list(hf(**batch, **{**kw, "return_dict": True}).keys()).index("logits")
    assert len(got) == len(want) >= 3 and got[at] is None and want[at].dim() == 3
    for i, (a, b) in enumerate(zip(got, want)):
        if i != at:
            assert type(a) is type(b)
            torch.testing.assert_close(a, b, **FP32)


def test_family_comes_from_the_checkpoint_and_a_mismatch_is_refused(family_path):
    """``model.name=auto`` takes the checkpoint's ``model_type``; a name it disagrees with is refused
    (the launcher builds this module tree on meta before any rank starts)."""
    cfg = qconfig.load(overrides=[f"model.path={family_path}", "model.init_device=meta"])
    assert type(registry.build(cfg.model)).__name__ == "QwenkitQwen2_5_VL"
    cfg = qconfig.load(overrides=[f"model.path={family_path}", "model.name=qwen3_vl"])
    with pytest.raises(ValueError, match="model.name='qwen3_vl' but .* model_type='qwen2_5_vl': use model.name=qwen2_5_vl"):
        registry.build(cfg.model)


@over_families(*[name for name in FAMILIES if families.get(name).aux_loss])  # the MoE families
def test_moe_aux_loss_is_in_the_training_loss_as_hf_adds_it(make_model, batch_factory):
    """The tiny MoE has output_router_logits on: HF's loss includes coef x aux, and so must ours
    (the family equality tests above would miss a dropped aux term if it were zero)."""
    ours = make_model(chunk=True, seed=1)
    batch = batch_factory(images_per_sample=(1, 0))
    out = ours(**batch, output_router_logits=True)  # 5.x's default from the config; 4.57 needs it passed
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    plain = ours(**batch, output_router_logits=False).loss
    coef = ours.config.text_config.router_aux_loss_coef
    torch.testing.assert_close(out.loss, plain + coef * out.aux_loss, **FP32)
