"""The synthetic datasets of the embedded default (qwenkit.model.tiny.data): the image set's layout and
the tone task, whose answer is the pitch its audio has."""

import json

import torch

from qwenkit.model.tiny import data as tiny_data


def test_synthetic_dataset_layout(tmp_path):
    path = tiny_data.write_dataset(tmp_path, n=6, seed=1)
    rows = json.loads(path.read_text())
    assert len(rows) == 6
    for row in rows:
        assert [m["role"] for m in row["messages"]][:2] == ["user", "assistant"]
        assert row["messages"][0]["content"].count("<image>") == len(row["images"]) == 1
        assert (tmp_path / row["images"][0]).is_file()
    assert any(len(r["messages"]) == 4 for r in rows)  # multi-turn samples exist


def test_the_tone_task_answers_the_pitch_its_audio_has(tmp_path):
    """Each tone's reply names the class whose pitch the decoded audio has (its spectrum's peak, measured with
    the pipeline's own decoder), 0.5 to 1 s long; the rows use the three LLaMA-Factory layouts."""
    from qwenkit.data import audio

    path = tiny_data.write_tone_dataset(tmp_path, n=9, seed=1)
    rows = json.loads(path.read_text())
    assert [next(k for k in ("messages", "conversations", "instruction") if k in r) for r in rows[:3]] == [
        "messages", "conversations", "instruction"]  # fmt: skip
    for row in rows:
        answer = (row.get("messages") or row.get("conversations") or [{}, {"content": row.get("output")}])[-1]
        answer = answer.get("content", answer.get("value"))
        wave = audio.decode(row["audios"][0], None, tmp_path)
        peak = abs(torch.fft.rfft(torch.from_numpy(wave)).abs().argmax().item()) * audio.SAMPLE_RATE / len(wave)
        nearest = min(tiny_data.TONES, key=lambda name: abs(tiny_data.TONES[name] - peak))
        assert answer == f"{nearest.capitalize()}." and 0.5 <= len(wave) / audio.SAMPLE_RATE <= 1.0
    assert tiny_data.ensure_dataset(4, root=tmp_path, task="tones") != tiny_data.ensure_dataset(4, root=tmp_path)
