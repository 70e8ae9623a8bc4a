"""Shared fixtures: the tiny checkpoint in a per-session cache, hand-built model batches, and
the references the data tests compare against.

Also the small set-ups several test files share: :func:`write_png` (a one-colour image file),
:func:`record_applied` (what each optimizer step applies), :func:`package_modules` (every
``qwenkit`` module by dotted name).

Model and loss tests build their batches here, independently of ``qwenkit.data``, so a bug
in the data pipeline cannot hide a bug in the model (and the other way round). Data tests
compare the pipeline's token ids with what transformers' own chat template makes of a row
(:func:`hf_reference_ids`).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from qwenkit import config as qconfig
from qwenkit.model.families import registry as families


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory):
    if "QWENKIT_CACHE" not in os.environ:
        os.environ["QWENKIT_CACHE"] = str(tmp_path_factory.mktemp("qwenkit-cache"))
    yield


@pytest.fixture(scope="session")
def tiny_path(_cache):
    from qwenkit.model.tiny.checkpoint import ensure_checkpoint

    return ensure_checkpoint()


@pytest.fixture(scope="session")
def processor(tiny_path):
    from qwenkit.model.processor import Processor

    return Processor.from_pretrained(tiny_path)


FAMILIES = tuple(families.FAMILIES)  # model.name of every family: the registry's one list


def over_families(*names: str):
    """Parametrize a test over these families (the ``family`` fixture); one this transformers cannot
    build (Qwen3.5 on 4.57) is skipped with the family entry's reason."""
    params = [pytest.param(n, marks=pytest.mark.skipif(bool(why := families.get(n).unavailable()), reason=why or ""))
              for n in names]  # fmt: skip
    return pytest.mark.parametrize("family", params, indirect=True)


# parametrize a test over the families (the ``family`` fixture; without it a test runs Qwen2.5-VL)
EVERY_FAMILY = over_families(*FAMILIES)


# the families that hear (an audio tower and <audio> placeholders): the Omni thinkers
AUDIO_FAMILY = over_families(*(n for n in FAMILIES if families.get(n).audio_tokens))


def families_allowing(feature: str):
    """:func:`over_families` for the families whose entry does not refuse ``feature`` (its ``not_exact``)."""
    return over_families(*(n for n in FAMILIES if feature not in families.get(n).not_exact))


@pytest.fixture
def family(request):
    """The model family a test runs (``model.name``); parametrize with :data:`EVERY_FAMILY`."""
    return getattr(request, "param", "qwen2_5_vl")


@functools.cache
def tiny_checkpoint(family: str = "qwen2_5_vl", whole: bool = False):
    """The family's tiny checkpoint; ``whole``: the whole model it is part of (a full Omni checkpoint)."""
    from qwenkit.model.tiny.checkpoint import ensure_checkpoint

    return ensure_checkpoint(family=family, whole=whole)


@functools.cache
def tiny_processor(family: str = "qwen2_5_vl"):
    from qwenkit.model.processor import Processor

    return Processor.from_pretrained(tiny_checkpoint(family))


@pytest.fixture
def family_path(_cache, family):
    return tiny_checkpoint(family)


@pytest.fixture
def family_processor(_cache, family):
    return tiny_processor(family)


def build_model(chunk=False, seed=None, **overrides):
    """The tiny model in fp32 (eval mode: no dropout anyway, but deterministic by contract)."""
    from qwenkit.model.families import build as registry

    cfg = qconfig.load(overrides={f"model.{k}": v for k, v in overrides.items()})
    m = registry.build(cfg.model, cfg.loss)
    m.configure_loss(chunk=chunk)
    if seed is not None:
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.05)
    return m


def make_batch(processor, images_per_sample=(1, 0, 2), seq_len=None, seed=0):
    """A right-padded batch: per sample, text tokens around ``n`` image spans, random labels.

    Labels: every second text run is "learned"; pad and image tokens are -100. Returns the
    kwargs of the model forward (``mm_token_type_ids`` included, the model drops it on 4.57).
    """
    g = torch.Generator().manual_seed(seed)
    ip = processor.image_processor
    vocab = len(processor.tokenizer) - 8  # ordinary tokens only
    rows, pix, grids = [], [], []
    for n_img in images_per_sample:
        ids, lab, typ = [], [], []
        for i in range(n_img + 1):
            text = torch.randint(0, vocab, (int(torch.randint(5, 20, (1,), generator=g)),), generator=g).tolist()
            ids += text
            lab += text if i % 2 == 0 else [-100] * len(text)
            typ += [0] * len(text)
            if i == n_img:
                break
            side = 56 + 28 * int(torch.randint(0, 3, (1,), generator=g))
            img = Image.fromarray((torch.rand(side, side + 28, 3, generator=g) * 255).byte().numpy())
            out = ip(images=[img], return_tensors="pt")
            pix.append(out["pixel_values"])
            grids.append(out["image_grid_thw"])
            n_tok = processor.image_tokens(out["image_grid_thw"][0])
            ids += [processor.vision_start_id] + [processor.image_token_id] * n_tok + [processor.vision_end_id]
            lab += [-100] * (n_tok + 2)
            typ += [0] + [1] * n_tok + [0]
        rows.append((ids, lab, typ))
    width = seq_len or max(len(r[0]) for r in rows)
    batch = {
        "input_ids": torch.full((len(rows), width), processor.pad_token_id),
        "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
        "labels": torch.full((len(rows), width), -100),
        "mm_token_type_ids": torch.zeros((len(rows), width), dtype=torch.int),
    }
    for b, (ids, lab, typ) in enumerate(rows):
        n = len(ids)
        batch["input_ids"][b, :n] = torch.tensor(ids)
        batch["attention_mask"][b, :n] = 1
        batch["labels"][b, :n] = torch.tensor(lab)
        batch["mm_token_type_ids"][b, :n] = torch.tensor(typ)
    if pix:
        batch["pixel_values"] = torch.cat(pix)
        batch["image_grid_thw"] = torch.cat(grids)
    return batch


@pytest.fixture
def make_model(_cache, family):
    """``build_model`` for the test's family (``name=`` overrides it)."""
    return functools.partial(build_model, name=family)


@pytest.fixture
def batch_factory(family_processor):
    def factory(**kw):
        return make_batch(family_processor, **kw)

    return factory


def make_cfg(**data):
    """The default config with ``data.<key>=value`` overrides."""
    return qconfig.load(overrides={f"data.{k}": v for k, v in data.items()})


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of True in a 1-D bool tensor."""
    out, start = [], None
    for i, v in enumerate(mask.tolist() + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


def hf_reference_ids(processor, row: dict, image_grids, video_grids=()) -> list[int]:
    """Token ids as transformers builds them: the checkpoint's chat template, then each
    <|image_pad|> / <|video_pad|> expanded to t*h*w/merge² copies (what Qwen2VLProcessor does)."""
    messages = []
    for m in row["messages"]:
        parts = []
        for k, piece in enumerate(re.split(r"(<image>|<video>)", m["content"])):
            if k % 2:  # a placeholder
                parts.append({"type": piece.strip("<>")})
            elif piece:
                parts.append({"type": "text", "text": piece})
        messages.append({"role": m["role"], "content": parts})
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    pieces = re.split(r"(<\|image_pad\|>|<\|video_pad\|>)", text)
    grids = {"<|image_pad|>": list(image_grids), "<|video_pad|>": list(video_grids)}
    assert {pad: pieces[1::2].count(pad) for pad in grids} == {pad: len(g) for pad, g in grids.items()}
    left = {pad: iter(g) for pad, g in grids.items()}
    text = "".join(p * processor.image_tokens(next(left[p])) if k % 2 else p for k, p in enumerate(pieces))
    return processor.tokenizer.encode(text, add_special_tokens=False)


def write_png(path: Path, size=(64, 48), colour=(200, 30, 30)) -> Path:
    """A one-colour RGB PNG of ``size`` (width, height) at ``path`` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def record_applied(optimizer) -> list[dict]:
    """The list an optimizer fills, before each of its steps, with what that step applies:
    ``{"lr": first group's LR, "adam_steps": Adam's count so far, "groups": {name: (lr, weight_decay)}}``
    (a group without a ``name`` goes by its index). The scheduler moves the LR only after the step.
    A step at LR 0 is not noted: DCP's ``get_state_dict`` initialises an empty optimizer state by one
    step at LR 0 (a run's schedule never is 0: ``min_lr_ratio > 0``, warmup from step 1)."""
    applied: list[dict] = []

    def note(o, args, kwargs):
        if o.param_groups[0]["lr"] == 0.0:
            return
        adam_steps = float(next(iter(o.state.values()))["step"]) if o.state else 0.0
        groups = {g.get("name", i): (g["lr"], g["weight_decay"]) for i, g in enumerate(o.param_groups)}
        applied.append({"lr": o.param_groups[0]["lr"], "adam_steps": adam_steps, "groups": groups})

    optimizer.register_step_pre_hook(note)
    return applied


PACKAGE = Path(__file__).resolve().parent.parent / "qwenkit"


def package_modules() -> dict[str, Path]:
    """Every module of the ``qwenkit`` package by dotted name (a package by its own name) -> its file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


# Weights after a few AdamW steps, two runs whose gradients differ by summation order only (2 ranks
# vs 1 process): AdamW's first step lr*g/(|g|+eps) swings by up to lr*delta/eps where a gradient
# element is within that noise delta of 0 (eps=1e-8, delta ~1e-10: 1e-4), up to a sign flip, 2*lr a
# step. Which elements, if any, depends on the CPU's kernels (one of 256 of one LoRA adapter on a
# faster Xeon), so a few may leave fp32's tolerance, none by more than 2*lr*steps. A wrong
# reduction or a shard left out moves whole tensors.
ILL_CONDITIONED = 1e-3  # at most this fraction of the trained elements


def assert_same_runs(got: list[dict], want: list[dict], uneven=("padding_fraction",)) -> None:
    """Two runs' logged metrics, step by step, equal to fp32 sums in another order (another world size, other
    micro-batches); ``uneven``: metrics their batching changes. ``ratio/*`` (the trainer's to the sampler's
    probability ratio) is 1 up to either batch's own fp32 ulps, so each run's is checked to be that small."""
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for k in a.keys() - set(uneven):
            if k.startswith("ratio/"):
                assert a[k] < 1e-5 and b[k] < 1e-5, (k, a[k], b[k])
            else:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), k


def assert_adamw_weights_close(got: dict, ref: dict, tol: dict, *, lr: float, steps: int, trained=None) -> None:
    """``got``/``ref``: full state dicts; ``trained``: the names that train (None: all), the others equal."""
    assert got.keys() == ref.keys()
    outside, total = {}, 0
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=2 * lr * steps, msg=lambda m, k=key: f"{k}: {m}")
        apart = int((~torch.isclose(got[key], value, **tol)).sum())
        if trained is not None and key not in trained:
            assert apart == 0, f"{key} does not train but moved"
            continue
        total += value.numel()
        if apart:
            outside[key] = apart
    assert sum(outside.values()) <= ILL_CONDITIONED * total, f"elements outside {tol} (of {total}): {outside}"
