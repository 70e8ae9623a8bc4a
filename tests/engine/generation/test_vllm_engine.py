"""vLLM as the kit's generation engine, against the kit's own HF generation (needs vLLM: make test-vllm).

On the tiny dense families as they are (head dim 32, vLLM's CPU attention runs it), float32: vLLM's greedy replies
equal the kit's HF greedy replies token for token, on text-only, one-image, two-image rows and a video row
(whose log-probs equal HF's: the same pixels and positions; reversed frames move them; Qwen2.5-VL's with the
engine's positions patch, :mod:`qwenkit.engine.generation.vllm_patches`, and 1e-4 away without it); after a
push of other weights, vLLM's replies equal HF's with those weights (and differ from before the push);
the engine leaves the process's threads, environment and RNG as they were. In a process each: Qwen3.5 (bf16,
:func:`_agrees`), Qwen3-VL-MoE (float32; its fused experts in Qwen's published layout) and Qwen3.5-MoE (bf16): vLLM's
replies agree with the kit's from the checkpoint, after 1 and after 3 pushes, after a push of other weights, and
(MoE) of a model with LoRA on its experts (= peft's merged copy); a push of the same weights leaves every tensor
vLLM holds as it loaded it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: make test-vllm runs these tests in .venv-vllm")

from multiproc import check_ranks  # noqa: E402

from engine.generation.test_generate import write_mixed_eval_set  # noqa: E402
from qwenkit import config as qconfig  # noqa: E402
from qwenkit import data  # noqa: E402
from qwenkit.engine.generation import generate as qgen  # noqa: E402
from qwenkit.engine.generation import vllm_engine, vllm_patches, vllm_requests  # noqa: E402
from qwenkit.model import lora  # noqa: E402
from qwenkit.model.families import registry as families  # noqa: E402
from qwenkit.model.families.vllm_limits import VLLM_CPU_HEAD_SIZES  # noqa: E402
from qwenkit.model.paths import load_processor  # noqa: E402
from qwenkit.model.processor import pixel_bounds  # noqa: E402
from qwenkit.model.tiny import vllm as tiny_vllm  # noqa: E402
from qwenkit.model.tiny.checkpoint import ensure_checkpoint  # noqa: E402

NEW_TOKENS = 12
SAMPLING = qgen.Sampling(max_new_tokens=NEW_TOKENS)  # greedy


def _eval_set(root, cfg, processor):
    """The generation tests' mixed held-out rows: text only, one and two images, a video; and for an Omni thinker a
    row with an audio (a tone, stereo 44.1 kHz: decoded, downmixed and resampled by the kit)."""
    path = write_mixed_eval_set(root)
    if processor.audio_ids:
        from data.test_audio import write_tone

        rows = json.loads(open(path).read())
        rows.append({"messages": [{"role": "user", "content": "<audio>What do you hear?"},
                                  {"role": "assistant", "content": "A tone."}], "audios": [str(write_tone(root / "a.wav"))]})  # fmt: skip
        open(path, "w").write(json.dumps(rows))
    dataset, _ = data.read_checked(cfg.data, processor, path)
    return dataset


# fp32 in this process; Qwen3.5 (bf16) and the MoE families: test_replies_* below, a process each
ENGINE_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


@pytest.fixture(scope="module", params=ENGINE_FAMILIES)
def setup(request, tmp_path_factory):
    """``(cfg, dataset, hf_model, engine, before)`` of one family; ``before``: process state before the engine."""
    path = ensure_checkpoint(family=request.param)  # the embedded default: vLLM runs it as it is
    cfg = qconfig.load(overrides=[f"model.path={path}", "data.max_length=2048", "data.tiny_samples=4"])
    processor = load_processor(cfg)
    dataset = _eval_set(tmp_path_factory.mktemp(request.param), cfg, processor)
    hf = families.of_directory(path).load("hf_class").from_pretrained(path, dtype=torch.float32).eval()
    before = _state()
    engine = vllm_engine.shared(vllm_engine.spec_of(cfg, processor, str(path)))
    return cfg, dataset, hf, engine, (before, _state())


def _state() -> dict:
    """What vLLM's CPU worker changes: threads (and the setter), environment, the global RNG."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    return {"env": env, "threads": torch.get_num_threads(), "setter": torch.set_num_threads,
            "rng": torch.random.get_rng_state()}  # fmt: skip


def _same(a: dict, b: dict) -> None:
    assert b["setter"] is a["setter"] and b["threads"] == a["threads"]
    assert b["env"] == a["env"]
    assert torch.equal(b["rng"], a["rng"])


def _served(dataset) -> list[int]:
    """The rows vLLM takes: all of them."""
    return list(range(len(dataset)))


def _kit_replies(model, dataset):
    return [r.tokens for r in qgen.generate_rows(model, dataset, _served(dataset), SAMPLING)]


def _vllm_replies(engine, dataset):
    return [r.tokens for r in vllm_engine.generate_rows(engine, dataset, _served(dataset), SAMPLING)]


def test_the_eval_set_has_text_one_image_two_image_and_video_rows(setup):
    _, dataset, *_ = setup
    images = sorted(len(dataset.image_refs(i)) for i in range(len(dataset)))
    assert images[0] == 0 and images[-1] == 2 and 1 in images
    assert sum(bool(dataset.index.videos(i)) for i in range(len(dataset))) == 1


def _greedy_log_probs(engine, asked: list[dict]) -> list[tuple[list[int], torch.Tensor]]:
    """vLLM's greedy tokens of each request and the log-prob of each (its prefix cache dropped first: a patch of
    the positions reaches a prompt it has seen)."""
    engine.llm.reset_prefix_cache()
    params = engine.params(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0)
    outs = [o.outputs[0] for o in engine.generate(asked, [params] * len(asked))]
    return [(list(o.token_ids), torch.tensor([step[t].logprob for step, t in zip(o.logprobs, o.token_ids)])) for o in outs]


def test_a_videos_log_probs_equal_hfs_and_follow_its_frames(setup):
    """vLLM's log-prob of each greedy token of the video row equals HF's full forward on the kit's inputs (the
    same pixels, grid and time positions, not only the same argmax); with the frames reversed they move.
    Qwen2.5-VL's only with the engine's positions patch (vLLM's own rule moves them by 1e-4 and more)."""
    _, dataset, hf, engine, _ = setup
    engine.push(hf)
    (row,) = [i for i in range(len(dataset)) if dataset.index.videos(i)]
    asked, inputs, _ = vllm_requests.request(dataset, row)
    frames, metadata = asked["multi_modal_data"]["video"][0]
    reversed_ = {**asked, "multi_modal_data": {"video": [(frames[::-1].copy(), metadata)]}}
    (tokens, got), (_, moved) = _greedy_log_probs(engine, [asked, reversed_])
    n = inputs["input_ids"].shape[1]
    full = {**inputs, "input_ids": torch.cat([inputs["input_ids"], torch.tensor([tokens])], 1)}
    full["attention_mask"] = torch.ones_like(full["input_ids"])
    if "mm_token_type_ids" in inputs:
        full["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, len(tokens)))
    with torch.no_grad():
        logits = hf(**full).logits[0, n - 1 : -1].float()  # [new, V] the logits each token was drawn from
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # fp32, other kernels: a few ulps of log-probs near -7
    assert (moved[:1] - got[:1]).abs().max() > 1e-3  # the first token's log-prob: another video, another prompt
    if dataset.processor.family.video_timestamps:
        return
    try:  # vLLM's own Qwen2.5-VL positions: the text after the video placed after its last temporal position
        assert vllm_patches.revert()
        (own, own_logps), = _greedy_log_probs(engine, [asked])
    finally:
        vllm_patches.apply()
    k = min(len(own), len(tokens))
    assert own != tokens or (own_logps[:k] - got[:k]).abs().max() > 1e-4


def test_after_a_push_vllm_equals_hf_with_those_weights(setup):
    _, dataset, hf, engine, _ = setup
    before = _vllm_replies(engine, dataset)
    other = type(hf)(hf.config).eval()  # other random weights
    torch.manual_seed(123)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_(0, 0.2)
    try:
        assert engine.push(other) == len(list(other.parameters()))
        got = _vllm_replies(engine, dataset)
        assert got == _kit_replies(other, dataset)
        assert got != before
    finally:
        engine.push(hf)


def test_the_engine_leaves_threads_environment_and_rng_as_they_were(setup):
    _, dataset, hf, engine, (before, after) = setup
    _same(before, after)  # starting the engine
    now = _state()
    engine.push(hf)
    _vllm_replies(engine, dataset)
    _same(now, _state())  # a push and a generation
    torch.set_num_threads(now["threads"])  # the real setter: vLLM's no-op is gone


def test_a_lora_model_is_pushed_merged(setup):
    """The push of a model with LoRA adapters (B random: a real delta) gives vLLM the merged weights; the
    adapters stay unmerged in the pushed model."""
    cfg, dataset, hf, engine, _ = setup
    adapted = copy.deepcopy(hf)
    lora.apply(adapted, qconfig.load(overrides=["lora.r=4", "lora.alpha=8"]).lora, seed=0)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)
    merged = lora.merge_in_place(copy.deepcopy(adapted))
    try:
        engine.push(adapted)
        got = _vllm_replies(engine, dataset)
        assert got == _kit_replies(merged, dataset)
        assert got != _kit_replies(hf, dataset)  # the adapters changed the replies
        assert lora.has_adapters(adapted) and any(".lora_A." in n for n, _ in adapted.named_parameters())
    finally:
        engine.push(hf)


def _agrees(hf, exact, dataset, replies) -> tuple[int, int]:
    """``(positions compared, disagreements)``: vLLM's bf16 greedy ``replies``, teacher-forced through the kit's bf16
    model ``hf``, are its argmax wherever its top-2 logit margin exceeds twice the bf16 error (the largest
    |bf16 - fp32| logit at those positions, ``exact`` the same weights in fp32): there each engine's own bf16 error
    cannot swap the top two, and a prefix that diverged cannot matter (each position is the kit's on vLLM's tokens)."""
    compared = wrong = 0
    media = {dataset.processor.image_token_id, dataset.processor.video_token_id}
    for i, reply in zip(_served(dataset), replies):
        # up to a media placeholder the random model may reply: HF would count it as an image's token
        reply = reply[: next((k for k, t in enumerate(reply) if t in media), len(reply))]
        inputs, _ = dataset.prompt(i)
        n = inputs["input_ids"].shape[1]
        full = {**inputs, "input_ids": torch.cat([inputs["input_ids"], torch.tensor([reply])], 1)}
        full["attention_mask"] = torch.ones_like(full["input_ids"])
        full["mm_token_type_ids"] = torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, len(reply)))
        with torch.no_grad():
            low = hf(**{k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full.items()})
            high = exact(**full)
        z, z32 = low.logits[0, n - 1 : -1].float(), high.logits[0, n - 1 : -1]  # [new, V]
        bound = 2 * (z - z32).abs().max()
        top = z.topk(2, dim=-1)
        sure = (top.values[:, 0] - top.values[:, 1]) > bound
        compared += int(sure.sum())
        wrong += int((top.indices[:, 0] != torch.tensor(reply))[sure].sum())
    return compared, wrong


def _replies_agree(engine, dataset, model, dtype) -> tuple[bool, int, list]:
    """``(agree, positions compared, replies)``: vLLM's greedy replies against the kit's from the float32 ``model``
    (float32: token for token; bf16: :func:`_agrees` with the kit's bf16 copy of ``model``)."""
    got = _vllm_replies(engine, dataset)
    if dtype == "float32":
        return got == _kit_replies(model, dataset), 0, got
    compared, wrong = _agrees(copy.deepcopy(model).to(torch.bfloat16), model, dataset, got)
    return wrong == 0, compared, got


def _other_weights(model, seed: int):
    """A copy of ``model`` with other random weights (the push must carry every tensor to reach its replies)."""
    other = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_(0, 0.2)
    return other


def _experts_adapted(model):
    """A copy of ``model`` with LoRA adapters on its linears and its routed experts (``lora.target_experts``), B
    random (a real delta); and the copy with them merged (peft's merge: the reference of the push's merge)."""
    adapted = copy.deepcopy(model)
    overrides = ["lora.r=4", "lora.alpha=8", "lora.target_experts=true", "lora.dropout=0"]
    lora.apply(adapted, qconfig.load(overrides=overrides).lora, seed=0)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)
    return adapted, lora.merge_in_place(copy.deepcopy(adapted))


def _engine_tensors(engine) -> dict:
    """Every tensor of vLLM's model as it holds them (after its CPU backend's padding and prepacking)."""

    def read(worker):
        return {k: v.detach().clone() for k, v in worker.model_runner.model.state_dict().items()}

    return engine.llm.collective_rpc(read)[0]


SAMPLED_T = 0.7  # the sampled log-probs' temperature (vLLM's processed_logprobs: after it, as the trainer's)


def _sampled_log_prob_gaps(engine, dataset, model) -> dict[str, float]:
    """``{row kind: max |vLLM's log-prob - the kit's|}`` of tokens vLLM samples (temperature :data:`SAMPLED_T`) on
    the audio row and the text-only row, the kit's from ``model``'s full forward over the prompt and those tokens;
    and ``audio_moved``: the audio row's first log-prob gap once vLLM hears noise instead (the audio reaches the
    model: another wave, another prompt; a tone reversed would not do, its spectrum is the same)."""
    rows = {"audio": next(i for i in _served(dataset) if dataset.index.grids(i, "audio")),
            "text": next(i for i in _served(dataset) if not dataset.image_refs(i) and not dataset.index.videos(i)
                         and not dataset.index.grids(i, "audio"))}  # fmt: skip
    gaps = {}
    for kind, i in rows.items():
        asked, inputs, _ = vllm_requests.request(dataset, i)
        requests = [asked]
        if kind == "audio":
            wave, rate = asked["multi_modal_data"]["audio"][0]
            noise = np.random.default_rng(0).uniform(-0.5, 0.5, wave.shape).astype(np.float32)  # as long: as many pads
            requests.append({**asked, "multi_modal_data": {"audio": [(noise, rate)]}})
        params = engine.params(max_tokens=NEW_TOKENS, temperature=SAMPLED_T, seed=7, logprobs=0)
        engine.llm.reset_prefix_cache()
        outs = [o.outputs[0] for o in engine.generate(requests, [params] * len(requests))]
        tokens = list(outs[0].token_ids)
        got = torch.tensor([step[t].logprob for step, t in zip(outs[0].logprobs, tokens)])
        n = inputs["input_ids"].shape[1]
        full = {**inputs, "input_ids": torch.cat([inputs["input_ids"], torch.tensor([tokens])], 1)}
        full["attention_mask"] = torch.ones_like(full["input_ids"])
        with torch.no_grad():
            logits = model(**full).logits[0, n - 1 : -1].float() / SAMPLED_T  # [new, V]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        gaps[kind] = float((got - want).abs().max())
        if kind == "audio":
            heard = outs[1].logprobs[0][outs[1].token_ids[0]].logprob  # the noise's first token
            first = torch.log_softmax(logits[0], -1)[outs[1].token_ids[0]]
            gaps["audio_moved"] = float(abs(heard - first))
    return gaps


def _isolated_worker(rank, out, family, dtype):
    """In a process of its own (vLLM sets up its parallel state once a process, with an expert group for MoE only):
    whether vLLM's replies agree with the kit's from the checkpoint, after 1 and after 3 pushes of the same weights,
    after a push of other weights, and (MoE) of a model with LoRA on its experts (fp32: token for token; bf16:
    :func:`_agrees`); and whether a push of the same weights leaves every tensor of vLLM's as loaded."""
    whole = families.get(family).whole is not None  # an Omni thinker: vLLM reads the whole model (vllm_omni)
    path = tiny_vllm.ensure_checkpoint(family) if family in tiny_vllm.FAMILIES else ensure_checkpoint(family=family, whole=whole)
    cfg = qconfig.load(overrides=[f"model.path={path}", "data.max_length=2048", "data.tiny_samples=4"])
    processor = load_processor(cfg)
    dataset = _eval_set(out, cfg, processor)
    exact = families.of_directory(path).load("hf_class").from_pretrained(path, dtype=torch.float32).eval()
    # spec_of refuses Qwen3.5 in float32: the spec it would make, with this dtype
    lo, hi = pixel_bounds(processor.image_processor)
    spec = vllm_engine.EngineSpec(str(path), dtype, 4096, cfg.train.seed, lo, hi, 0.3, 1.0, False)
    engine = vllm_engine.start_engine(spec)
    result = {}
    result["loaded"], result["loaded_compared"], before = _replies_agree(engine, dataset, exact, dtype)
    loaded = _engine_tensors(engine)
    for n in (1, 2, 3):
        assert engine.push(exact) == len(list(exact.parameters()))
        if n in (1, 3):
            result[f"pushed_{n}"], result[f"pushed_{n}_compared"], _ = _replies_agree(engine, dataset, exact, dtype)
            if processor.audio_ids:  # an Omni thinker: sampled log-probs on the audio row and the text-only row
                result[f"sampled_{n}"] = _sampled_log_prob_gaps(engine, dataset, exact)
    pushed = _engine_tensors(engine)
    result["tensors_changed"] = sorted(k for k in loaded if not torch.equal(loaded[k], pushed[k]))
    other = _other_weights(exact, 123)
    engine.push(other)
    result["other"], result["other_compared"], got = _replies_agree(engine, dataset, other, dtype)
    result["other_moved"] = got != before
    if whole:  # the thinker-only checkpoint (the kit's tiny default): vLLM starts on dummy weights, the push brings them
        alone = ensure_checkpoint(family=family)
        engine = vllm_engine.start_engine(dataclasses.replace(spec, model_dir=str(alone)))
        result["dummy_moved"] = _vllm_replies(engine, dataset) != before
        engine.push(exact)
        result["thinker_only"] = _replies_agree(engine, dataset, exact, dtype)[0]
    # (the Omni thinkers' LoRA paths name transformers 5.24's module tree, .venv-vllm has 5.19's: model.layers)
    if families.get(family).experts and not whole:
        adapted, merged = _experts_adapted(exact)
        engine.push(adapted)
        result["lora"], result["lora_compared"], got = _replies_agree(engine, dataset, merged, dtype)
        result["lora_moved"] = got != before
    (out / "result.json").write_text(json.dumps(result))


@pytest.fixture(scope="module", params=[("qwen3_5", "bfloat16"), ("qwen3_vl_moe", "float32"), ("qwen3_5_moe", "bfloat16"),
                                        ("qwen2_5_omni", "float32")], ids=lambda p: p[0])  # fmt: skip
def isolated(request, tmp_path_factory):
    """``(family, dtype, result)`` of :func:`_isolated_worker`. Qwen3.5's Gated DeltaNet runs in bf16 only on vLLM's
    CPU backend, with linear-attention head dims of 128 (:mod:`qwenkit.model.tiny.vllm` widens the tiny Qwen3.5s');
    the tiny Qwen3-VL-MoE's copy there has its experts in Qwen's published layout, which vLLM reads."""
    out = tmp_path_factory.mktemp(request.param[0])
    check_ranks(_isolated_worker, 1, out, *request.param)
    return (*request.param, json.loads((out / "result.json").read_text()))


def test_replies_from_the_checkpoint_agree_with_the_kits(isolated):
    *_, result = isolated
    assert result["loaded"]
    assert result["loaded_compared"] > 0 or isolated[1] == "float32", result  # bf16: positions sure enough exist


@pytest.mark.parametrize("push", ["pushed_1", "pushed_3", "other"])
def test_replies_after_pushes_agree_with_the_kits(isolated, push):
    """After 1 and 3 pushes of the checkpoint's weights, and after a push of other weights (which moves the
    replies): the MoE families' fused experts (vLLM's reload makes its CPU kernel pad and prepack them again,
    ``vllm_engine._reprocess_experts``) and Qwen3.5's linear-attention layers (vLLM #48284: its layerwise reload
    corrupting Mamba / GDN layers) take every push."""
    family, dtype, result = isolated
    assert result[push], result
    assert result[f"{push}_compared"] > 0 or dtype == "float32", result
    assert result["other_moved"]


def test_a_thinker_only_checkpoint_starts_on_dummy_weights_and_agrees_after_a_push(isolated):
    """An Omni thinker saved alone (no ``thinker.`` weights for vLLM): its engine starts on vLLM's dummy weights
    (``vllm_omni.engine_dir``), whose replies are not the kit's, and the first push makes them the kit's."""
    family, _, result = isolated
    if families.get(family).whole is None:
        pytest.skip(f"{family} is no part of a whole model")
    assert result["dummy_moved"] and result["thinker_only"], result


def test_a_push_of_the_same_weights_leaves_every_tensor_of_vllms_as_loaded(isolated):
    """Three pushes of the checkpoint's own weights: every tensor vLLM holds (its kernels' padded, prepacked
    layouts included) is bit for bit what it loaded; in bf16 except Qwen3.5's ``A_log`` (vLLM keeps it in float32,
    as the checkpoint holds it; the push sends the trainer's weights in model.dtype)."""
    family, dtype, result = isolated
    if dtype == "float32":
        assert result["tensors_changed"] == [], result
    else:
        assert all(k.endswith(".linear_attn.A_log") for k in result["tensors_changed"]), result


@pytest.mark.parametrize("push", [1, 3])
def test_sampled_log_probs_with_audio_equal_the_kits(isolated, push):
    """An Omni thinker after 1 and 3 pushes: the log-prob of each token vLLM samples, on the audio row and the
    text-only row, equals the kit's full forward over the same tokens within 1e-5 (fp32, other kernels: a few ulps
    of log-probs near -7, as the video row's); noise instead of the tone moves the first one (vLLM hears the audio)."""
    family, dtype, result = isolated
    if not families.get(family).audio_tokens:
        pytest.skip(f"{family} has no audio tower")
    gaps = result[f"sampled_{push}"]
    assert gaps["audio"] < 1e-5 and gaps["text"] < 1e-5, gaps
    assert gaps["audio_moved"] > 1e-3, gaps


def test_a_push_of_lora_on_the_experts_is_merged(isolated):
    """``lora.target_experts``: each expert's adapter merged into its fused weight as peft merges it
    (``push_tensors.merged``); vLLM's replies equal the kit's from peft's merged copy, and the adapters moved them."""
    family, dtype, result = isolated
    if not families.get(family).experts:
        pytest.skip(f"{family} has no routed experts")
    if families.get(family).whole is not None:
        pytest.skip(f"{family}'s LoRA paths name transformers 5.24's module tree; vLLM 0.32's venv has 5.19")
    assert result["lora"] and result["lora_moved"], result
    assert result["lora_compared"] > 0 or dtype == "float32", result


def test_the_head_dims_refused_before_the_start_are_the_ones_vllms_cpu_attention_cannot_run():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert VLLM_CPU_HEAD_SIZES == tuple(CPUAttentionBackend.get_supported_head_sizes())
