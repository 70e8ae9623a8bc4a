"""Audio entries → PyAV-decoded mono 16 kHz waves → the log-mel features an Omni thinker hears.

The ``audios`` column (LLaMA-Factory's, ms-swift's) holds paths, relative to the dataset file or
absolute, or ``data:audio/...;base64,`` URIs. Each is decoded with PyAV (the kit's video decoder;
torchaudio does not load here), resampled by FFmpeg's resampler to 32-bit floats at 16 kHz and
averaged over its channels to one, what Qwen-Omni's feature extractor expects.

Features: transformers' ``WhisperFeatureExtractor`` as Qwen-Omni's processors call it (128 mel bins,
10 ms hop, padded to its 30 s window), then cut to the audio's own frames
(``feature_attention_mask``'s sum): a batch pads them again to its longest audio. The extractor
*truncates* anything longer than its window without a word (transformers #41473); here an audio
longer than the window is a bad sample that names the file, the row, its length and the limit
(:func:`features`), never a silently shortened one.
"""

from __future__ import annotations

import base64
import importlib
import io
import re
import types
from pathlib import Path

import numpy as np
import torch

from qwenkit.data.conversation import AUDIO_PLACEHOLDER, VIDEO_PLACEHOLDER
from qwenkit.data.report import REBUILD, BadSample, Location

SAMPLE_RATE = 16_000  # Hz: what the Omni audio towers were trained on
MEL_BINS = 128
HOP = 160  # samples per mel frame (10 ms)
WINDOW_S = 30  # the feature extractor's window (chunk_length): longer audio is refused


def _source(entry: str, base_dir: Path | None):
    """A file-like object or path for PyAV: a decoded data URI, else the path (relative to ``base_dir``)."""
    if entry.startswith("data:"):
        header, _, payload = entry.partition(",")
        if ";base64" not in header:
            raise ValueError("a data URI must be base64 (data:audio/...;base64,...)")
        return io.BytesIO(base64.b64decode(payload, validate=True))
    path = Path(entry).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise FileNotFoundError(f"no such file {str(path)!r}")
    return str(path)


def decode(entry: str, where: Location, base_dir: Path | None = None) -> np.ndarray:
    """The audio of ``entry`` as float32 mono samples at :data:`SAMPLE_RATE` ``[n]``; a missing or
    undecodable one is a :class:`BadSample` naming ``entry`` and ``where`` (file and row)."""
    label = entry if not entry.startswith("data:") else entry[:32] + "..."
    try:
        source = _source(entry, base_dir)
    except FileNotFoundError as e:
        raise BadSample(where, "missing_audio", f"audio {label}: {e}") from None
    except ValueError as e:
        raise BadSample(where, "corrupt_audio", f"audio {label}: {e}") from None
    return _decode(source, where, f"audio {label}", "corrupt_audio", "the file has no audio stream")


def track(ref, where: Location) -> np.ndarray:
    """The audio track of video ``ref`` (a :class:`~qwenkit.data.images.MediaRef`: a file or bytes) as
    :func:`decode` gives an audio file's. A video without one (frame files, a silent file) is a
    :class:`BadSample` (``silent_video``): HF's Omni processors give a silent video a plain video span, but the
    thinkers' ``get_rope_index`` under ``use_audio_in_video`` places only videos with their audio (one flag per
    batch: a plain span's frames would get text positions), so such a row cannot train with the others."""
    label = ref.label  # "video k of n ('name')"
    if ref.frames is not None:
        raise BadSample(where, "silent_video", f"{label} is a list of frame files: it has no audio track, which "
                                               "data.use_audio_in_video needs for every video")  # fmt: skip
    if ref.data is None and not ref.path.is_file():
        raise BadSample(where, "missing_video", f"{label}: no such file {str(ref.path)!r}")
    source = io.BytesIO(ref.data) if ref.data is not None else str(ref.path)
    silent = "it has no audio track, which data.use_audio_in_video needs for every video"
    return _decode(source, where, label, "corrupt_audio", silent, "silent_video")


def _decode(source, where: Location, label: str, reason: str, no_stream: str, no_stream_reason: str | None = None):
    """The first audio stream of ``source`` (a path or a file-like object) as float32 mono 16 kHz ``[n]``; what
    does not decode is a :class:`BadSample` of ``reason``, a file without an audio stream one of
    ``no_stream_reason`` (default: ``reason``) saying ``no_stream``."""
    import av  # the video extra's FFmpeg bindings: only rows with audio need them

    # resampled per channel, then averaged (librosa's mono, what peers' loaders give): FFmpeg's own
    # downmix weighs channels by 1/sqrt(2), 1.41 x the average of a centred stereo signal
    resampler = av.AudioResampler(format="fltp", rate=SAMPLE_RATE)
    pieces, silent = [], False
    try:
        with av.open(source) as container:
            silent = not container.streams.audio
            if not silent:
                for frame in container.decode(audio=0):
                    pieces += [f.to_ndarray().mean(axis=0) for f in resampler.resample(frame)]  # [channels, n] -> [n]
                pieces += [f.to_ndarray().mean(axis=0) for f in resampler.resample(None)]  # flush
    except (av.FFmpegError, OSError, ValueError) as e:
        raise BadSample(where, reason, f"{label}: cannot decode: {e}") from None
    if silent:
        raise BadSample(where, no_stream_reason or reason, f"{label}: {no_stream}")
    wave = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if wave.size == 0:
        raise BadSample(where, reason, f"{label}: no sample decodes")
    return wave.astype(np.float32, copy=False)


def feature_extractor():
    """transformers' Whisper feature extractor with Qwen-Omni's settings (128 bins, 16 kHz, 30 s window)."""
    from transformers import WhisperFeatureExtractor  # the tokenizer stack: only when audio is read

    return WhisperFeatureExtractor(feature_size=MEL_BINS, sampling_rate=SAMPLE_RATE, hop_length=HOP, chunk_length=WINDOW_S)


def _check_length(wave: np.ndarray, extractor, where: Location, label: str) -> None:
    window = extractor.n_samples  # chunk_length * sampling_rate
    if len(wave) > window:
        raise BadSample(
            where, "long_audio",
            f"audio {label} is {len(wave) / SAMPLE_RATE:.1f} s, longer than the feature extractor's "
            f"{window / SAMPLE_RATE:.0f} s window (it would be cut silently); split it into pieces of at most that",
        )  # fmt: skip


def features(wave: np.ndarray, extractor, where: Location, label: str) -> torch.Tensor:
    """Log-mel features ``[128, frames]`` of one wave, as HF's Omni processor computes them (padded to the
    window, then cut to the audio's frames); longer than the window: a :class:`BadSample` (``long_audio``)."""
    _check_length(wave, extractor, where, label)
    return row_features([wave], extractor, "max_length")[0]


def row_features(waves: list[np.ndarray], extractor, padding: str) -> list[torch.Tensor]:
    """Each of one row's waves as log-mel features ``[128, frames_k]``: the extractor called once on all of
    them, as HF's processor calls it on a conversation's audios (``padding``: :func:`padding_rule`), each
    cut to the frames its attention mask keeps."""
    out = extractor(waves, sampling_rate=SAMPLE_RATE, return_attention_mask=True, padding=padding, truncation=False,
                    return_tensors="pt")  # fmt: skip
    return [out["input_features"][k, :, : int(m.sum())] for k, m in enumerate(out["attention_mask"])]


def _processing(family):
    """The processor module of the entry's transformers submodule (``processing_qwen3_omni_moe``, ...)."""
    name = family.hf_module or family.model_type
    return importlib.import_module(f"transformers.models.{name}.processing_{name}")


def padding_rule(family) -> str:
    """How HF's processor of ``family`` pads a call's audios before the log-mel: ``max_length`` (Qwen2.5-Omni:
    each to the 30 s window) or ``longest`` (Qwen3-Omni: ``audio_kwargs`` ``padding=True``, to the longest of
    the call). It decides the last frames: an audio that ends the padded length loses its partial last hop
    (``frames``), and its last frame sees the STFT's reflection instead of zeros."""
    module = _processing(family)
    (processor,) = (getattr(module, name) for name in module.__all__ if name.endswith("Processor"))
    defaults = getattr(processor, "audio_kwargs", None)
    if defaults is None:  # transformers before 5.2x (vLLM 0.32's 5.19): its kwargs class's defaults
        (kwargs,) = (getattr(module, name) for name in dir(module) if name.endswith("ProcessorKwargs"))
        defaults = kwargs._defaults["audio_kwargs"]
    padding = defaults.get("padding", "max_length")
    return "longest" if padding is True else padding


def frames(samples: list[int], padded: int) -> list[int]:
    """Mel frames of audios of ``samples`` samples padded together to ``padded`` samples, as the extractor's
    attention mask counts them: one per started hop, but at most ``padded // HOP`` (the STFT's last frame is
    dropped, and the mask with it when ``padded`` is no multiple of the hop)."""
    return [min(-(-n // HOP), padded // HOP) for n in samples]


def token_counter(family):
    """HF's own count of an audio's placeholder tokens from its mel frames, for ``family`` (an Omni entry):
    ``_get_feat_extract_output_lengths`` of the processor module of the entry's transformers submodule,
    the function ``Qwen2_5OmniProcessor`` / ``Qwen3OmniMoeProcessor`` expand ``<audio>`` with."""
    module = _processing(family)
    if hasattr(module, "_get_feat_extract_output_lengths"):
        return module._get_feat_extract_output_lengths
    # transformers before 5.2x (vLLM 0.32's 5.19): Qwen2.5-Omni's processor counts inline as its audio encoder does
    name = family.hf_module or family.model_type
    encoder = importlib.import_module(f"transformers.models.{name}.modeling_{name}").Qwen2_5OmniAudioEncoder
    return lambda frames: encoder._get_feat_extract_output_lengths(None, frames)[1]


def _entry(entry, where: Location, k: int, n: int) -> str:
    if not isinstance(entry, str) or not entry:
        raise BadSample(where, "bad_format", f"audio {k} of {n} must be a path or a data: URI, got {entry!r:.80}")
    return entry


def heard(conv, tracks: bool) -> list[tuple[str, int]]:
    """What the thinker hears of ``conv``, in the order of its placeholders (the order HF's processor is given
    them and scatters their features into the pads): ``("audio", k)`` for the ``k``-th ``<audio>``, and with
    ``tracks`` (``data.use_audio_in_video``) ``("video", j)`` for the ``j``-th ``<video>``'s own audio track.
    Placeholders stand in user turns only (:mod:`qwenkit.data.conversation` checks it)."""
    tags = (AUDIO_PLACEHOLDER, VIDEO_PLACEHOLDER) if tracks else (AUDIO_PLACEHOLDER,)
    pattern = "|".join(re.escape(t) for t in tags)
    found = [tag for role, text in conv.turns if role == "user" for tag in re.findall(pattern, text)]
    counts = {AUDIO_PLACEHOLDER: 0, VIDEO_PLACEHOLDER: 0}
    out = []
    for tag in found:
        out.append(("audio" if tag == AUDIO_PLACEHOLDER else "video", counts[tag]))
        counts[tag] += 1
    return out


def waves(conv, base_dir: Path | None) -> list[np.ndarray]:
    """The waves of the row's ``<audio>`` entries, in order (float32 mono at :data:`SAMPLE_RATE` ``[n]`` each, each
    within the window): a vLLM request's audio (:mod:`qwenkit.engine.generation.vllm_requests`)."""
    return _waves(conv, base_dir, feature_extractor(), None)


def _waves(conv, base_dir: Path | None, extractor, videos: list | None) -> list[np.ndarray]:
    """The waves of :func:`heard` (``videos``: the row's video refs when their tracks are heard, else None)."""
    waves = []
    for kind, k in heard(conv, videos is not None):
        if kind == "audio":
            label = _entry(conv.audios[k], conv.where, k, len(conv.audios))
            waves.append(decode(label, conv.where, base_dir))
        else:
            label = videos[k].label
            waves.append(track(videos[k], conv.where))
        _check_length(waves[-1], extractor, conv.where, label)
    return waves


def measure(conv, base_dir: Path | None, family, videos: list | None = None) -> list[tuple[int, int, int]]:
    """``(mel frames, placeholder tokens, samples)`` of each audio the row's thinker hears (:func:`heard`:
    ``videos``, the row's video refs, when their tracks are heard), decoded once (the scan), as HF's processor
    of ``family`` counts them for the row's audios in one call.

    A family without an audio tower (no ``audio_tokens`` in its entry) given audio: a bad row that says so."""
    heard_n = len(conv.audios) + len(videos or ())
    if not heard_n:
        return []
    if not family.audio_tokens:
        raise BadSample(
            conv.where, "no_audio_tower",
            f"the row has {heard_n} audio{'s' if heard_n != 1 else ''} (its 'audios', and its videos' tracks with "
            f"data.use_audio_in_video) but model family {family.name} has no audio tower; train a family that "
            "hears (README's family table), or drop them",
        )  # fmt: skip
    extractor = feature_extractor()
    lengths = [len(w) for w in _waves(conv, base_dir, extractor, videos)]
    padded = extractor.n_samples if padding_rule(family) == "max_length" else max(lengths)
    count = token_counter(family)
    return [(n, int(count(n)), samples) for n, samples in zip(frames(lengths, padded), lengths)]


def video_span(family, grid: tuple[int, int, int], second_per_grid: float, audio_tokens: int, merge: int) -> str:
    """The pads between ``audio_start`` and ``audio_end`` of a video heard with its audio track, as ``V`` (a video
    pad) and ``A`` (an audio pad): HF's own ``replace_video_with_audio_token`` of ``family``'s processor, called
    with the processor's ``position_id_per_seconds`` and ``seconds_per_chunk``. Qwen2.5-Omni writes per 2-s
    chunk the chunk's video pads then its audio pads; Qwen3-Omni merges both by time (a video patch before the
    audio pads of its start time). ``grid``: the video's patch grid; ``merge``: the spatial merge size."""
    module = _processing(family)
    (cls,) = (getattr(module, name) for name in module.__all__ if name.endswith("Processor"))
    hf = cls.__new__(cls)  # only what the method reads: the tokens as letters, the merge size
    hf.audio_bos_token, hf.audio_eos_token, hf.video_token, hf.audio_token = "", "", "V", "A"
    hf.video_processor = types.SimpleNamespace(merge_size=merge)
    videos = {"video_grid_thw": [list(grid)], "video_second_per_grid": [second_per_grid]}
    return hf.replace_video_with_audio_token(videos, 0, {"num_audio_tokens": [audio_tokens]}, 0,
                                             position_id_per_seconds=cls.position_id_per_seconds,
                                             seconds_per_chunk=cls.seconds_per_chunk)  # fmt: skip


def load(conv, base_dir: Path | None, expected: list[int], family, videos: list | None = None) -> dict[str, torch.Tensor]:
    """The thinker's inputs of the audios ``conv``'s thinker hears (:func:`heard`, ``videos`` as in
    :func:`measure`), in that order: ``input_features [n_audio, 128, F]`` and
    ``feature_attention_mask [n_audio, F]`` (``F``: the longest audio's frames; shorter ones padded with
    0), checked against the scan's frames ``expected`` (an audio that changed: ``changed_media``)."""
    extractor = feature_extractor()
    made = row_features(_waves(conv, base_dir, extractor, videos), extractor, padding_rule(family))  # [128, f] each
    got = [int(f.shape[1]) for f in made]
    if got != list(expected):
        raise BadSample(
            conv.where, "changed_media",
            f"the audios have {got} mel frames but the index has {list(expected)}: an audio changed after the index "
            f"was built; {REBUILD}",
        )  # fmt: skip
    width = max(got)
    feats = torch.zeros(len(made), MEL_BINS, width, dtype=made[0].dtype)  # [n_audio, 128, F]
    mask = torch.zeros(len(made), width, dtype=torch.long)  # [n_audio, F]
    for k, f in enumerate(made):
        feats[k, :, : f.shape[1]] = f
        mask[k, : f.shape[1]] = 1
    return {"input_features": feats, "feature_attention_mask": mask}
