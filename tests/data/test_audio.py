"""qwenkit.data.audio: PyAV decoding to mono 16 kHz, bad audio named by file and row, no silent cut."""

import base64

import av
import numpy as np
import pytest

from qwenkit.data import audio
from qwenkit.data.report import BadSample, Location

WHERE = Location("set.json", row=3)


def write_tone(path, hz=440.0, seconds=1.0, rate=44_100, channels=2):
    """A sine tone as 16-bit PCM WAV (stereo 44.1 kHz by default: decoding must downmix and resample)."""
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.5 * np.sin(2 * np.pi * hz * t) * 32767).astype(np.int16)
    layout = "stereo" if channels == 2 else "mono"
    with av.open(str(path), "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(np.repeat(wave, channels)[None], format="s16", layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return path


def _pitch(wave):
    spectrum = np.abs(np.fft.rfft(wave))
    return np.argmax(spectrum) * audio.SAMPLE_RATE / len(wave)


def test_a_stereo_44k_tone_decodes_to_mono_16k_at_its_pitch(tmp_path):
    wave = audio.decode("a.wav", WHERE, base_dir=write_tone(tmp_path / "a.wav", hz=440.0).parent)
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert abs(len(wave) - audio.SAMPLE_RATE) <= 64  # 1 s, up to the resampler's filter delay
    # the channels' average (librosa's mono): two equal channels of amplitude 0.5 stay 0.5
    assert abs(_pitch(wave) - 440.0) < 2.0 and 0.45 < np.abs(wave).max() < 0.55


def test_a_data_uri_decodes_as_its_file(tmp_path):
    path = write_tone(tmp_path / "b.wav", hz=660.0, seconds=0.5, rate=16_000, channels=1)
    uri = "data:audio/wav;base64," + base64.b64encode(path.read_bytes()).decode()
    np.testing.assert_array_equal(audio.decode(uri, WHERE), audio.decode(str(path), WHERE))


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda d: "gone.wav", "missing_audio"),
        (lambda d: (d / "junk.wav").write_bytes(b"RIFF not really a wav file" * 10) and "junk.wav", "corrupt_audio"),
        (lambda d: "data:audio/wav,notbase64", "corrupt_audio"),
    ],
)
def test_bad_audio_is_named_by_file_and_row(tmp_path, make, reason):
    entry = make(tmp_path)
    with pytest.raises(BadSample) as e:
        audio.decode(entry, WHERE, base_dir=tmp_path)
    assert e.value.reason == reason
    assert "set.json" in str(e.value) and "3" in str(e.value) and entry[:20] in str(e.value)


def test_features_are_the_extractors_frames_of_the_audio_and_longer_audio_is_refused_not_cut(tmp_path):
    extractor = audio.feature_extractor()
    wave = audio.decode(str(write_tone(tmp_path / "c.wav", seconds=2.5, rate=16_000, channels=1)), WHERE)
    feats = audio.features(wave, extractor, WHERE, "c.wav")
    assert feats.shape == (audio.MEL_BINS, len(wave) // audio.HOP)  # 250 frames of 10 ms
    padded = extractor(wave, sampling_rate=audio.SAMPLE_RATE, return_tensors="pt")["input_features"][0]
    assert padded.shape[1] == 3000  # what HF's processor hands the model: the 30 s window
    np.testing.assert_array_equal(feats.numpy(), padded[:, :250].numpy())
    long = np.zeros(31 * audio.SAMPLE_RATE, np.float32)
    with pytest.raises(BadSample, match=r"row 3.*long.wav is 31.0 s, longer than the feature extractor's 30 s window") as e:
        audio.features(long, extractor, WHERE, "long.wav")
    assert e.value.reason == "long_audio"
