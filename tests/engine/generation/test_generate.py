"""HF's ``generate`` on the qwenkit subclass (chunk loss off) gives HF's class's tokens.

``generate`` validates its model kwargs against ``forward``'s signature, so the subclass must
expose the parent's parameters (images, video, ``inputs_embeds``), on transformers 5.x and 4.57.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import FAMILIES, over_families
from model.families.test_chunked import _video_batch
from transformers import Qwen2_5_VLForConditionalGeneration

from qwenkit.model import processor
from qwenkit.model.families import qwen2_5_vl
from qwenkit.model.families import registry as families
from qwenkit.model.families.spec import of_run

NEW_TOKENS = 6


@pytest.fixture
def pair(make_model, family, family_path):
    """The subclass with random weights, and HF's own class of the family holding the very same weights."""
    ours = make_model(chunk=False, seed=7).eval()
    stock = families.get(family).load("hf_class").from_pretrained(family_path).eval()
    stock.load_state_dict(ours.state_dict())
    return ours, stock


def _prompt(batch: dict, model=None) -> dict:
    """A generation prompt: no labels; ``mm_token_type_ids`` only where transformers takes it (and
    ``model``'s forward does: the Omni thinkers' has none)."""
    keep = {k: v for k, v in batch.items() if k != "labels"}
    if not processor.needs_mm_token_type_ids() or (model is not None and "mm_token_type_ids" not in
                                                     inspect.signature(model.forward).parameters):  # fmt: skip
        keep.pop("mm_token_type_ids", None)
    return keep


def _generate(model, **kwargs):
    with torch.no_grad():
        return model.generate(**kwargs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)


def test_forward_exposes_the_parents_parameters():
    ours = inspect.signature(qwen2_5_vl.QwenkitQwen2_5_VL.forward).parameters
    parent = inspect.signature(Qwen2_5_VLForConditionalGeneration.forward).parameters
    assert list(ours)[: len(parent) - 1] == list(parent)[:-1]  # same names, same positional order
    assert {"num_items_in_batch", "num_samples", "return_dict", "kwargs"} <= set(ours)


# Qwen2.5-VL and the Omni thinkers (GRPO's rollouts generate with them; Qwen3.5: tests/model/families/test_qwen3_5.py)
@over_families("qwen2_5_vl", *(n for n in FAMILIES if families.get(n).audio_tokens))
def test_generate_with_images_equals_hf(pair, batch_factory):
    ours, stock = pair
    prompt = _prompt(batch_factory(images_per_sample=(2,), seed=3), stock)
    got, want = _generate(ours, **prompt), _generate(stock, **prompt)
    assert got.shape[1] == prompt["input_ids"].shape[1] + NEW_TOKENS
    assert torch.equal(got, want)


def test_generate_with_video_equals_hf(pair, processor):
    ours, stock = pair
    prompt = _prompt(_video_batch(processor, seed=2))
    got, want = _generate(ours, **prompt), _generate(stock, **prompt)
    assert got.shape[1] == prompt["input_ids"].shape[1] + NEW_TOKENS
    assert torch.equal(got, want)


def test_generate_from_inputs_embeds_equals_hf(pair, batch_factory):
    ours, stock = pair
    prompt = _prompt(batch_factory(images_per_sample=(0,), seed=4))
    embeds = ours.get_input_embeddings()(prompt.pop("input_ids")).detach()
    prompt.pop("mm_token_type_ids", None)  # text only
    got, want = _generate(ours, inputs_embeds=embeds, **prompt), _generate(stock, inputs_embeds=embeds, **prompt)
    assert got.shape[1] == NEW_TOKENS  # from embeddings, generate returns the new tokens only
    assert torch.equal(got, want)


def test_positional_arguments_follow_the_parents_order(pair, batch_factory):
    ours, stock = pair
    batch = batch_factory(images_per_sample=(0, 0), seed=5)
    with torch.no_grad():
        got = ours(batch["input_ids"], batch["attention_mask"]).logits
        want = stock(batch["input_ids"], batch["attention_mask"]).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Batched, left-padded generation equals one row at a time


def write_mixed_eval_set(root) -> str:
    """Held-out rows of every kind in one file: the tiny set's (one image, one or two turns),
    a text-only row, a two-image row and a video row; prompts of different lengths."""
    import json

    from PIL import Image
    from videos import write_video

    from qwenkit.model.tiny.data import write_dataset

    path = write_dataset(root, n=3, seed=11)
    rows = json.loads(path.read_text())
    Image.new("RGB", (80, 56), (30, 90, 200)).save(root / "blue.png")
    write_video(root / "clip.avi", 64, 48, 8, 4)
    rows += [
        {"messages": [{"role": "user", "content": "Name a colour, in one short word please."},
                      {"role": "assistant", "content": "Blue."}]},
        {"messages": [{"role": "user", "content": "<image>and<image>: same colour?"}, {"role": "assistant", "content": "No."}],
         "images": ["blue.png", rows[0]["images"][0]]},
        {"messages": [{"role": "user", "content": "<video>What moves?"}, {"role": "assistant", "content": "A square."}],
         "videos": ["clip.avi"]},
    ]  # fmt: skip
    (root / "eval.json").write_text(json.dumps(rows))
    return str(root / "eval.json")


@pytest.fixture(scope="module")
def mixed_eval_set(tmp_path_factory, processor):
    from qwenkit import config as qconfig
    from qwenkit import data

    path = write_mixed_eval_set(tmp_path_factory.mktemp("mixed"))
    cfg = qconfig.load(overrides=["data.tiny_samples=16", "data.max_length=2048"])
    dataset, _ = data.read_checked(cfg.data, processor, path)
    return dataset


def todays_replies(model, dataset, indices, max_new_tokens):
    """The reference: one ``generate`` call per row, no padding, greedy, decoded at <|im_end|>."""
    tok = dataset.processor.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    with torch.no_grad():
        for i in indices:
            inputs, _ = dataset.prompt(i)
            inputs = {k: v for k, v in inputs.items() if k in inspect.signature(model.forward).parameters}  # HF's own keys
            tokens = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=im_end,
                                    pad_token_id=dataset.processor.pad_token_id)  # fmt: skip
            new = tokens[0, inputs["input_ids"].shape[1] :].tolist()
            out.append(new[: new.index(im_end)] if im_end in new else new)
    return out


@pytest.fixture(scope="module")
def stock_and_replies(tiny_path, mixed_eval_set):
    """HF's class with random weights (fp32), and its one-row replies to every row, last row first."""
    from conftest import build_model

    stock = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_path).eval()
    stock.load_state_dict(build_model(seed=7).state_dict())
    indices = list(range(len(mixed_eval_set)))[::-1]  # any order in, the same order out
    return stock, indices, todays_replies(stock, mixed_eval_set, indices, NEW_TOKENS)


@pytest.mark.parametrize("batch_size", [1, 4])  # 4: batches of 4 and 2 (lengths 37..63, a video among them)
def test_batched_generation_equals_one_row_at_a_time(stock_and_replies, mixed_eval_set, batch_size):
    from qwenkit.engine.generation import generate as qgen

    stock, indices, want = stock_and_replies
    lengths = {int(mixed_eval_set.prompt(i)[0]["input_ids"].shape[1]) for i in indices}
    assert len(lengths) > 3  # prompts of different lengths share batches
    rows = qgen.generate_rows(stock, mixed_eval_set, indices, qgen.Sampling(NEW_TOKENS, batch_size=batch_size))
    assert [r.index for r in rows] == indices
    assert [r.tokens for r in rows] == want
    tok = mixed_eval_set.processor.tokenizer
    assert [r.generated for r in rows] == [qgen.reply_text(tok, t) for t in want]  # the tokens as text, broken bytes escaped


def test_sampling_is_seeded_per_rank_and_leaves_the_training_rng_alone(stock_and_replies, mixed_eval_set):
    from qwenkit import config as qconfig
    from qwenkit.engine.generation import generate as qgen

    stock, indices, greedy = stock_and_replies
    indices, greedy = indices[:4], greedy[:4]  # one batch
    cfg = qconfig.load(overrides=["train.eval_temperature=1.5", "train.eval_top_p=0.9", "train.eval_batch_size=4",
                                  f"train.eval_max_new_tokens={NEW_TOKENS}", "train.seed=3"])  # fmt: skip
    sampling = qgen.Sampling.of(cfg.train)
    assert sampling == qgen.Sampling(NEW_TOKENS, batch_size=4, temperature=1.5, top_p=0.9, seed=3)
    state = torch.random.get_rng_state()
    first = [r.tokens for r in qgen.generate_rows(stock, mixed_eval_set, indices, sampling)]
    assert torch.equal(torch.random.get_rng_state(), state)  # the training RNG did not move
    assert [r.tokens for r in qgen.generate_rows(stock, mixed_eval_set, indices, sampling)] == first
    assert first != greedy  # it samples
    assert [r.tokens for r in qgen.generate_rows(stock, mixed_eval_set, indices, sampling, rank=1)] != first


# ---------------------------------------------------------------------------------------------
# gather or lockstep: train.eval_generation=auto's rule


def test_reply_text_shows_broken_bytes_as_escapes_and_valid_text_as_the_tokenizer_does(family_processor):
    """A reply whose tokens split a multi-byte character: its bytes as ``\\xNN``, not U+FFFD (what
    the gallery of notebook 02 showed for an untrained model); valid text is the tokenizer's own."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from qwenkit.engine.generation import generate

    tok = family_processor.tokenizer
    byte_token = {b: tok.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    utf8 = "é".encode()  # two bytes; the first alone is no character
    beyond = len(tok) + 3  # an untrained model's embedding rows past the tokenizer's vocabulary
    ids = [byte_token[utf8[0]], beyond, *tok.encode("red", add_special_tokens=False)]
    assert "\ufffd" in tok.decode(ids, skip_special_tokens=True)  # what the tokenizer shows
    assert generate.reply_text(tok, ids) == (utf8[:1] + b"red").decode("utf-8", errors="backslashreplace")
    assert generate.reply_text(tok, ids) == "\\xc3red"
    whole = tok.encode("a red circle é", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert generate.reply_text(tok, whole) == tok.decode(whole, skip_special_tokens=True) == "a red circle é"


MOE = tuple(name for name in FAMILIES if families.get(name).experts)  # the families with routed experts


@over_families(*MOE)
def test_a_moe_run_evaluates_batched_prompts_with_the_router_aux_loss_on(tmp_path, family):
    """The probe's crash (issue 54): HF 5.x computes the router's aux loss in every forward of
    ``generate``, and a decoding step's router logits do not match a left-padded batch's mask.
    Through the trainer (the tiny MoE's config has the aux loss on): the replies of batches of 4
    (prompts of different lengths) equal HF's class generating the exported weights one row at a time."""
    from qwenkit import config as qconfig
    from qwenkit.engine.checkpoints import export
    from qwenkit.engine.generation import evaluate
    from qwenkit.engine.generation import generate as qgen
    from qwenkit.engine.run import train

    cfg = qconfig.load(overrides=[
        f"model.name={family}", "train.resume=none", "train.steps=1", "train.warmup_steps=0", "data.tiny_samples=4",
        "data.tiny_eval_samples=4", "train.eval_samples=4", "train.eval_batch_size=4", "train.eval_max_new_tokens=4",
        f"train.output_dir={tmp_path}",
    ])  # fmt: skip
    trainer = train.Trainer(cfg)
    trainer.run()
    assert trainer.model.config.get_text_config().output_router_logits
    dataset = trainer.evaluator.dataset
    indices = trainer.evaluator.samples
    assert len({int(dataset.prompt(i)[0]["input_ids"].shape[1]) for i in indices}) > 1  # left padding in the batch
    rows = qgen.read_jsonl(evaluate.generations_path(tmp_path, 1))
    stock = export.load_hf(tmp_path / "checkpoints" / "step-00000001", cfg, of_run(cfg.model)).eval()
    assert [r["tokens"] for r in rows] == todays_replies(stock, dataset, sorted(indices), 4)


@over_families(*(n for n in FAMILIES if families.get(n).audio_tokens))
def test_batched_generation_of_audio_prompts_equals_one_row_at_a_time(_cache, tmp_path, family):
    """Tone prompts of different audio lengths, left-padded into one batch (their features padded to the longest
    audio, ``join_media``), give the replies HF's class generates for each prompt alone."""
    from conftest import build_model

    from qwenkit import config as qconfig
    from qwenkit import data
    from qwenkit.engine.generation import generate as qgen
    from qwenkit.model.paths import load_processor

    cfg = qconfig.load(overrides={"model.name": family, "data.tiny_task": "tones", "data.tiny_samples": 5,
                                  "data.cache_dir": str(tmp_path / "c")})  # fmt: skip
    dataset, _ = data.read_checked(cfg.data, load_processor(cfg))
    frames = {dataset.index.grids(i, "audio")[0][0] for i in range(len(dataset))}
    assert len(frames) > 2  # audios of different lengths share the batch
    model = build_model(seed=7, name=family).eval()
    indices = list(range(len(dataset)))
    want = todays_replies(model, dataset, indices, NEW_TOKENS)
    rows = qgen.generate_rows(model, dataset, indices, qgen.Sampling(NEW_TOKENS, batch_size=5))
    assert [r.tokens for r in rows] == want and sum(map(len, want)) > len(want)  # replies, not empty ones


@over_families(*(n for n in FAMILIES if families.get(n).audio_tokens))
@pytest.mark.parametrize("heard", [False, True], ids=["video", "heard"])
def test_an_omni_video_prompt_generates_as_hfs_class_given_its_own_keywords(_cache, tmp_path, family, heard):
    """An Omni thinker's prompt with a video (``heard``: with ``data.use_audio_in_video``, its track interleaved)
    through the kit's generation (evaluation's replies, GRPO's rollouts): HF's ``generate`` places the prompt's
    positions before the first forward from keywords (the video seconds under the thinker's name,
    ``use_audio_in_video``), so the prefill's positions must be HF's ``get_rope_index`` with them (the tiny
    Qwen3-Omni's logits barely move with positions: its tokens alone would not tell) and the greedy reply HF's
    class's, given the same prompt under its own keywords."""
    from conftest import build_model, tiny_checkpoint

    from qwenkit.engine.generation import generate as qgen
    from tests.data.test_audio_rows import _read, write_heard_set

    rows = write_heard_set(tmp_path)
    dataset, report = _read(tmp_path, rows, family, use_audio_in_video=heard)
    assert report.skipped == 0
    model = build_model(seed=7, name=family).eval()
    stock = families.get(family).load("hf_class").from_pretrained(tiny_checkpoint(family)).eval()
    stock.load_state_dict(model.state_dict())
    prompt, _ = dataset.prompt(0)
    assert "second_per_grid_ts" in prompt and model.heard_videos(prompt["input_ids"]) == heard
    seen = []  # the decoder's positions at each forward; the prefill's first
    hook = model.model.language_model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)  # fmt: skip
    (row,) = qgen.generate_rows(model, dataset, [0], qgen.Sampling(NEW_TOKENS))
    hook.remove()
    own = {k: v for k, v in prompt.items() if k not in ("mm_token_type_ids", "second_per_grid_ts")}
    own |= {"video_second_per_grid": prompt["second_per_grid_ts"], "use_audio_in_video": heard}
    end = dataset.processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = qgen.generation_config(qgen.Sampling(NEW_TOKENS), end, dataset.processor.pad_token_id)
    with torch.no_grad():
        want = stock.generate(**own, generation_config=config)[0, prompt["input_ids"].shape[1] :].tolist()
    assert row.tokens == (want[: want.index(end)] if end in want else want)
    positions, _ = stock.model.get_rope_index(prompt["input_ids"], None, prompt["video_grid_thw"],
                                              prompt["attention_mask"], heard, prompt["feature_attention_mask"].sum(1),
                                              prompt["second_per_grid_ts"])  # fmt: skip
    torch.testing.assert_close(seen[0][-3:].float(), positions.float(), rtol=0, atol=0)
