"""The embedded default: a tiny model of each family, an offline processor and a learnable synthetic dataset.

Nothing here downloads anything. :func:`ensure_checkpoint` writes a complete HF checkpoint
directory (config, safetensors weights, tokenizer, image processor) into a cache folder, so the
tiny model is loaded by exactly the code path a real checkpoint takes (``model.build``).

The architecture is the real one at toy sizes: each family's entry (:mod:`qwenkit.model.family`)
names its config builder in :mod:`qwenkit.model.tiny_configs`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image, ImageDraw
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from qwenkit.model import family as families
from qwenkit.model.processor import CHAT_TEMPLATE, SPECIAL_TOKENS, THINK_TOKENS, ImageProcessor, Processor

# Qwen2's pre-tokenizer regex. Without it transformers 5.x re-tokenizes differently after save/load.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TINY_VOCAB = 1024  # BPE merges are trained up to this size, then padded to a multiple of 64
TINY_IMAGE_SIDE = 112  # 112 px = 8x8 patches of 14 = 16 image tokens after the 2x2 merge
TINY_MIN_PIXELS = 56 * 56
TINY_MAX_PIXELS = 112 * 112

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
    "purple": (150, 60, 190),
    "white": (245, 245, 245),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
NUMBER_WORDS = ("zero", "one", "two", "three", "four")
EVAL_SEED = 1  # the held-out synthetic set (data.tiny_eval_samples); training rows use seed 0


# ---------------------------------------------------------------------------------------------
# Offline processor


def _corpus() -> list[str]:
    """Every question and answer the synthetic dataset can contain, plus the template's words."""
    lines = ["You are a helpful assistant.", "system", "user", "assistant"]
    for colour in COLOURS:
        for shape in SHAPES:
            for count in range(1, 5):
                for position in POSITIONS:
                    facts = {"colour": colour, "shape": shape, "count": count, "position": position}
                    for kind in ("colour", "shape", "count", "position"):
                        lines.extend(_qa_of(kind, facts))
    return lines


def build_tokenizer(chat_template: str = CHAT_TEMPLATE, added: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Qwen's pre-tokenizer and special tokens, trained on the synthetic corpus;
    ``chat_template``: the family's (:attr:`qwenkit.model.family_entry.Family.chat_template`); ``added``:
    its added, not special, tokens (Qwen3.5's thinking tags)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB - len(SPECIAL_TOKENS) - len(added),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens(list(added))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=chat_template,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def build_processor(family: str = families.TINY_DEFAULT) -> Processor:
    entry = families.get(family)
    side = entry.patch_size * entry.merge_size  # pixels per merged token: 28 (Qwen2.5-VL), 32 (Qwen3-VL)
    image_processor = ImageProcessor(
        min_pixels=TINY_MIN_PIXELS * side**2 // 28**2,
        max_pixels=TINY_MAX_PIXELS * side**2 // 28**2,
        patch_size=entry.patch_size,
        temporal_patch_size=2,
        merge_size=entry.merge_size,
    )
    added = (THINK_TOKENS if entry.think_tags else ()) + entry.audio_tokens
    return Processor(build_tokenizer(entry.load("chat_template"), added), image_processor, entry)


# ---------------------------------------------------------------------------------------------
# Checkpoint directory


def _cache_root() -> Path:
    return Path(os.environ.get("QWENKIT_CACHE", Path.home() / ".cache" / "qwenkit"))


def ensure_checkpoint(
    tie_word_embeddings: bool = False,
    seed: int = 0,
    root: str | Path | None = None,
    family: str = families.TINY_DEFAULT,
    whole: bool = False,
    reshape: Reshape | None = None,
) -> Path:
    """Write (once) and return an HF checkpoint directory holding the seeded tiny model of ``family``;
    ``whole``: the whole model it is part of (a full Omni checkpoint: thinker, talker, vocoder);
    ``reshape``: its config changed first (:mod:`qwenkit.model.tiny_vllm`'s widths).

    The directory name hashes everything that determines its content, so a stale one is never
    reused; it is written under a temporary name and renamed, so concurrent ranks are safe.
    """
    if problem := families.get(family).unavailable():  # a known family this transformers can build
        raise ValueError(problem)
    if whole and families.get(family).whole is None:
        raise ValueError(f"{family} is no part of a whole model (its entry's whole is None)")
    key = json.dumps(
        {"v": 1, "tie": tie_word_embeddings, "seed": seed, "tf": transformers.__version__, "torch": torch.__version__}
        | ({"family": family, "template": 2, "mtp": 1} if family != families.TINY_DEFAULT else {})  # 2: the family's chat template
        | ({"whole": 2} if whole else {})  # 2: every tensor outside the part drawn
        | ({"reshape": reshape.name, "reshape_version": reshape.version} if reshape is not None else {})
    )
    root = Path(root) if root is not None else _cache_root()
    prefix = f"tiny-{reshape.name}" if reshape is not None else "tiny"
    path = root / f"{prefix}-{family}{'-whole' if whole else ''}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if (path / "config.json").is_file():
        return path
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # with a process group, transformers' save_pretrained writes weights on rank 0 only:
        # rank 0 writes, the others wait for it (every rank calls this collectively)
        if dist.get_rank() == 0:
            _write_checkpoint(root, path, tie_word_embeddings, seed, family, whole, reshape)
        dist.barrier()
        return path
    _write_checkpoint(root, path, tie_word_embeddings, seed, family, whole, reshape)
    return path


def _write_checkpoint(root: Path, path: Path, tie_word_embeddings: bool, seed: int, family: str, whole: bool,
                      reshape) -> None:  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    try:
        save_checkpoint(tmp, tie_word_embeddings=tie_word_embeddings, seed=seed, family=family, whole=whole,
                        reshape=reshape)  # fmt: skip
        if not (tmp / "model.safetensors").is_file():
            raise RuntimeError(f"tiny checkpoint in {tmp} has no weights after save_pretrained")
        try:
            tmp.rename(path)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@dataclass(frozen=True)
class Reshape:
    """A change of a family's tiny config before its model is built (``apply(config)``, in place), named
    and versioned: both key the checkpoint's directory."""

    name: str
    version: int
    apply: Callable
    published_layout: bool = False  # weights written as the family's published checkpoints hold them (Family.checkpoint_tensor)


def save_checkpoint(
    path: str | Path, tie_word_embeddings: bool = False, seed: int = 0, family: str = families.TINY_DEFAULT,
    whole: bool = False, reshape: Reshape | None = None,
) -> None:  # fmt: skip
    entry = families.get(family)
    processor = build_processor(family)
    vocab = len(processor.tokenizer)
    ids = {t: processor.tokenizer.convert_tokens_to_ids(t) for t in (*SPECIAL_TOKENS, *entry.audio_tokens)}
    config = entry.load("tiny_config")(-(-vocab // 64) * 64, ids, tie_word_embeddings)
    if reshape is not None:
        reshape.apply(config)
    if entry.mtp_layers:  # as the family's checkpoints say it (vLLM and SGLang read it)
        config.text_config.mtp_num_hidden_layers = entry.mtp_layers
    torch.manual_seed(seed)
    if whole:  # the whole model around the family's
        config = entry.whole.load("tiny_config")(config)
        model = entry.whole.load("hf_class")(config)
        _draw_the_rest(model, entry.whole.prefix, seed)
    else:
        model = entry.load("hf_class")(config)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    for name in entry.whole.files if whole else ():
        WHOLE_FILES[name](Path(path) / name, config)
    if entry.mtp_layers:
        _add_mtp(Path(path), model, entry.mtp_layers)
    if reshape is not None and reshape.published_layout and entry.checkpoint_transposed:
        from safetensors.torch import load_file, save_file

        file = Path(path) / "model.safetensors"  # the tiny model: one file
        weights = {k: entry.checkpoint_tensor(k, v).contiguous() for k, v in load_file(file).items()}
        save_file(weights, file, metadata={"format": "pt"})


@torch.no_grad()
def _draw_the_rest(model, prefix: str, seed: int) -> None:
    """Seeded values for every tensor of a whole model outside its part: HF's init leaves some of the talker's
    (its experts) as the allocator found them, so two writes would differ and a NaN could be among them."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if not name.startswith(prefix):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def _write_speakers(file: Path, config) -> None:
    """Qwen2.5-Omni's ``spk_dict.pt`` at toy sizes (HF's class of the whole refuses a directory without it):
    one speaker, its condition vector, reference mel frames and the codec's start token."""
    dit = config.token2wav_config.dit_config
    g = torch.Generator().manual_seed(2)
    torch.save({"Chelsie": {"cond": torch.randn(dit.enc_emb_dim, generator=g), "ref_mel": torch.randn(1, 8, dit.mel_dim, generator=g),
                            "bos_token": config.talker_config.tts_codec_start_token_id}}, file)  # fmt: skip


# the files beside the weights a whole model's checkpoints ship (Whole.files), each name's tiny writer
WHOLE_FILES = {"spk_dict.pt": _write_speakers}


def _add_mtp(path: Path, model, layers: int) -> None:
    """Add Qwen3.5's multi-token-prediction layer to the checkpoint at ``path``, as real ones hold it (vLLM's
    key names: ``mtp.fc`` [H, 2H], two input norms, full-attention decoder layers, ``mtp.norm``), so that
    every tiny run's export must keep it."""
    from safetensors.torch import load_file, save_file

    text = model.config.text_config
    hidden = text.hidden_size
    decoder = model.model.language_model.layers
    full = next(i for i, kind in enumerate(text.layer_types) if kind == "full_attention")
    g = torch.Generator().manual_seed(1)
    mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * text.initializer_range,
           "mtp.pre_fc_norm_embedding.weight": torch.ones(hidden), "mtp.pre_fc_norm_hidden.weight": torch.ones(hidden),
           "mtp.norm.weight": torch.ones(hidden)}  # fmt: skip
    for n in range(layers):
        mtp |= {f"mtp.layers.{n}.{k}": v.detach().clone() for k, v in decoder[full].state_dict().items()}
    weights = load_file(path / "model.safetensors")  # the tiny model: one file
    save_file(weights | mtp, path / "model.safetensors", metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# Synthetic dataset: coloured shapes, questions about colour, shape, count and position


def _draw(rng: random.Random, side: int = TINY_IMAGE_SIDE):
    colour = rng.choice(list(COLOURS))
    shape = rng.choice(SHAPES)
    count = rng.randint(1, 4)
    background = (20, 20, 20) if colour != "white" else (90, 90, 90)
    image = Image.new("RGB", (side, side), background)
    draw = ImageDraw.Draw(image)
    quadrants = sorted(rng.sample(range(4), count))  # reading order: "the first shape" is well defined
    half = side // 2
    for q in quadrants:
        x0, y0 = (q % 2) * half + 8, (q // 2) * half + 8
        box = (x0, y0, x0 + half - 16, y0 + half - 16)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=COLOURS[colour])
    return image, {"colour": colour, "shape": shape, "count": count, "position": POSITIONS[quadrants[0]]}


def _qa(rng: random.Random, facts: dict) -> tuple[str, str]:
    return _qa_of(rng.choice(("colour", "shape", "count", "position")), facts)


def _qa_of(kind: str, facts: dict) -> tuple[str, str]:
    plural = "s" if facts["count"] > 1 else ""
    if kind == "colour":
        return "What colour are the shapes?", f"They are {facts['colour']}."
    if kind == "shape":
        return "Which shape is shown?", f"A {facts['shape']}."
    if kind == "count":
        return "How many shapes are there?", f"There {'are' if plural else 'is'} {NUMBER_WORDS[facts['count']]}."
    return "Where is the first shape?", f"In the {facts['position']}."


def write_dataset(out_dir: str | Path, n: int = 64, seed: int = 0) -> Path:
    """Write ``n`` samples as ``tiny.json`` plus PNG images; returns the JSON path.

    A third of the samples are two-turn conversations (two questions about the same image), so
    multi-turn masking is exercised by the embedded default too.
    """
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        image, facts = _draw(rng)
        name = f"images/{i:05d}.png"
        image.save(out_dir / name)
        q1, a1 = _qa(rng, facts)
        messages = [{"role": "user", "content": f"<image>{q1}"}, {"role": "assistant", "content": a1}]
        if i % 3 == 2:
            q2, a2 = _qa(rng, facts)
            messages += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
        rows.append({"messages": messages, "images": [name]})
    path = out_dir / "tiny.json"
    path.write_text(json.dumps(rows, indent=1))
    return path


_WRONG = {"colour": list(COLOURS), "count": [1, 2, 3, 4], "position": list(POSITIONS)}
# What the preference pairs ask about: what the tiny model's 16 image tokens let it tell apart. Not
# the shape: after params/tiny_cpu.yaml the SFT start prefers the right shape in 0.57 of 145 train
# pairs (a coin toss), and 120 DPO steps moved the shape pairs' reward margin by 0.05 (colour 5.4,
# count 2.3, position 3.0): pairs it cannot see only add noise to the held-out accuracy.
PREFERENCE_KINDS = tuple(_WRONG)


def write_preference_dataset(out_dir: str | Path, n: int = 64, seed: int = 0) -> Path:
    """Write ``n`` preference pairs as ``tiny.json`` plus PNG images; returns the JSON path.

    One question about the image; the chosen reply states the right fact, the rejected one the
    same sentence with a wrong colour, count or position (:data:`PREFERENCE_KINDS`). The rows rotate through the
    three accepted preference layouts (ms-swift, TRL conversational with typed parts,
    LLaMA-Factory sharegpt), so the embedded default reads each of them.
    """
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        image, facts = _draw(rng)
        name = f"images/{i:05d}.png"
        image.save(out_dir / name)
        kind = rng.choice(PREFERENCE_KINDS)
        wrong = dict(facts, **{kind: rng.choice([v for v in _WRONG[kind] if v != facts[kind]])})
        question, chosen = _qa_of(kind, facts)
        rejected = _qa_of(kind, wrong)[1]
        if i % 3 == 0:  # ms-swift
            rows.append({"messages": [{"role": "user", "content": f"<image>{question}"},
                                      {"role": "assistant", "content": chosen}],
                         "rejected_response": rejected, "images": [name]})  # fmt: skip
        elif i % 3 == 1:  # TRL, conversational, typed parts
            rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}], "images": [name]})  # fmt: skip
        else:  # LLaMA-Factory sharegpt preference
            rows.append({"conversations": [{"from": "human", "value": f"<image>{question}"}],
                         "chosen": {"from": "gpt", "value": chosen}, "rejected": {"from": "gpt", "value": rejected},
                         "images": [name]})  # fmt: skip
    path = out_dir / "tiny.json"
    path.write_text(json.dumps(rows, indent=1))
    return path


# ---------------------------------------------------------------------------------------------
# Synthetic audio task (data.tiny_task=tones): which of three well-separated pitches a short tone has

TONES = {"low": 300.0, "mid": 1000.0, "high": 3000.0}  # Hz; each tone within 5 % of its class's pitch
TONE_RATE = 16_000  # Hz: what the Omni feature extractor takes, so no resampling


def write_tone(path: Path, hz: float, seconds: float, amplitude: float) -> None:
    """A sine tone as mono 16-bit PCM WAV at :data:`TONE_RATE` (the standard library's writer)."""
    t = np.arange(int(seconds * TONE_RATE)) / TONE_RATE
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(TONE_RATE)
        out.writeframes((amplitude * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2").tobytes())


def write_tone_dataset(out_dir: str | Path, n: int = 64, seed: int = 0) -> Path:
    """Write ``n`` rows asking a tone's pitch (``Low.``, ``Mid.``, ``High.``) as ``tiny.json`` plus WAVs (0.5 to
    1 s, 16 kHz); returns the JSON path. The rows rotate through LLaMA-Factory's messages, sharegpt and alpaca
    layouts, each with an ``audios`` column and one ``<audio>`` tag, so the embedded default reads each."""
    out_dir = Path(out_dir)
    (out_dir / "tones").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        pitch = rng.choice(list(TONES))
        name = f"tones/{i:05d}.wav"
        write_tone(out_dir / name, TONES[pitch] * rng.uniform(0.95, 1.05), rng.uniform(0.5, 1.0), rng.uniform(0.3, 0.8))
        question, answer = "<audio>Is this tone low, mid or high?", f"{pitch.capitalize()}."
        if i % 3 == 0:
            rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                         "audios": [name]})  # fmt: skip
        elif i % 3 == 1:
            rows.append({"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
                         "audios": [name]})  # fmt: skip
        else:
            rows.append({"instruction": question, "output": answer, "audios": [name]})
    path = out_dir / "tiny.json"
    path.write_text(json.dumps(rows, indent=1))
    return path


_WRITERS = {"shapes": write_dataset, "tones": write_tone_dataset}  # data.tiny_task -> its writer


def ensure_dataset(
    n: int = 64, seed: int = 0, root: str | Path | None = None, preference: bool = False, task: str = "shapes"
) -> Path:
    """The synthetic dataset of ``task`` (``data.tiny_task``; ``preference``: the shapes' pairs) in the cache
    folder, written once per (task, n, seed)."""
    root = Path(root) if root is not None else _cache_root()
    if preference and task != "shapes":
        raise ValueError(f"data.tiny_task={task!r} has no preference pairs; the tiny pairs are the shapes'")
    name = f"tiny-pairs-n{n}-s{seed}-v3" if preference else f"tiny-data-n{n}-s{seed}-v2"
    path = root / (name if task == "shapes" else f"tiny-{task}-n{n}-s{seed}-v1")
    if (path / "tiny.json").is_file():
        return path / "tiny.json"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".data-", dir=root))
    try:
        (write_preference_dataset if preference else _WRITERS[task])(tmp, n=n, seed=seed)
        try:
            tmp.rename(path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path / "tiny.json"
