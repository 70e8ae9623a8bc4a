"""qwenkit.model.tiny: the embedded default: the tiny model's config and checkpoint, the synthetic dataset (its processor: test_processor.py)."""

import json

import torch

from qwenkit.model import tiny, tiny_data


def test_tiny_config_is_the_real_architecture(tiny_path):
    cfg = json.loads((tiny_path / "config.json").read_text())
    vision = cfg["vision_config"]
    assert vision["depth"] == 2 and vision["fullatt_block_indexes"] == [1]  # one windowed, one full
    text = cfg.get("text_config", cfg)
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert sum(rope["mrope_section"]) == head_dim // 2


def test_forward_backward_gives_grad_on_every_trainable_param(make_model, batch_factory):
    model = make_model(chunk=False)
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 <= n <= 5_000_000
    out = model(**batch_factory())
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_checkpoint_is_seeded_and_reused(tmp_path):
    a = tiny.ensure_checkpoint(root=tmp_path / "a")
    b = tiny.ensure_checkpoint(root=tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert tiny.ensure_checkpoint(root=tmp_path / "a") == a


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
