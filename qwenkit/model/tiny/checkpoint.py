"""The embedded default: a tiny model of each family and an offline processor (its learnable synthetic
datasets: :mod:`qwenkit.model.tiny.data`).

Nothing here downloads anything. :func:`ensure_checkpoint` writes a complete HF checkpoint
directory (config, safetensors weights, tokenizer, image processor) into a cache folder, so the
tiny model is loaded by exactly the code path a real checkpoint takes (``model.build``).

The architecture is the real one at toy sizes: each family's entry (:mod:`qwenkit.model.families.registry`)
names its config builder in :mod:`qwenkit.model.families.tiny_configs`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from qwenkit.model.families import registry as families
from qwenkit.model.processor import CHAT_TEMPLATE, SPECIAL_TOKENS, THINK_TOKENS, ImageProcessor, Processor
from qwenkit.model.tiny.data import cache_root, corpus

# Qwen2's pre-tokenizer regex. Without it transformers 5.x re-tokenizes differently after save/load.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TINY_VOCAB = 1024  # BPE merges are trained up to this size, then padded to a multiple of 64
TINY_MIN_PIXELS = 56 * 56
TINY_MAX_PIXELS = 112 * 112



# ---------------------------------------------------------------------------------------------
# Offline processor


def build_tokenizer(chat_template: str = CHAT_TEMPLATE, added: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Qwen's pre-tokenizer and special tokens, trained on the synthetic corpus;
    ``chat_template``: the family's (:attr:`qwenkit.model.families.entry.Family.chat_template`); ``added``:
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
    tok.train_from_iterator(corpus(), trainer=trainer)
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
    ``reshape``: its config changed first (:mod:`qwenkit.model.tiny.vllm`'s).

    The directory name hashes everything that determines its content, so a stale one is never
    reused; it is written under a temporary name and renamed, so concurrent ranks are safe.
    """
    if problem := families.get(family).unavailable():  # a known family this transformers can build
        raise ValueError(problem)
    if whole and families.get(family).whole is None:
        raise ValueError(f"{family} is no part of a whole model (its entry's whole is None)")
    key = json.dumps(  # v 2: head dims of 32 (vLLM's CPU attention), Qwen3-VL-MoE's experts 16 wide
        {"v": 2, "tie": tie_word_embeddings, "seed": seed, "tf": transformers.__version__, "torch": torch.__version__}
        | ({"family": family, "template": 2, "mtp": 1} if family != families.TINY_DEFAULT else {})  # 2: the family's chat template
        | ({"whole": 2} if whole else {})  # 2: every tensor outside the part drawn
        | ({"reshape": reshape.name, "reshape_version": reshape.version} if reshape is not None else {})
    )
    root = Path(root) if root is not None else cache_root()
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
    full = next(i for i, kind in enumerate(text.layer_types) if kind != "linear_attention")  # Qwen4-Exp's: indexed
    g = torch.Generator().manual_seed(1)
    mtp = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * text.initializer_range,
           "mtp.pre_fc_norm_embedding.weight": torch.ones(hidden), "mtp.pre_fc_norm_hidden.weight": torch.ones(hidden),
           "mtp.norm.weight": torch.ones(hidden)}  # fmt: skip
    for n in range(layers):
        mtp |= {f"mtp.layers.{n}.{k}": v.detach().clone() for k, v in decoder[full].state_dict().items()}
    weights = load_file(path / "model.safetensors")  # the tiny model: one file
    save_file(weights | mtp, path / "model.safetensors", metadata={"format": "pt"})
