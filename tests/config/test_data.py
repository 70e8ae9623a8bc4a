"""qwenkit.config.data: the data section's ranges and allowed names, refused by key and value."""

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("data.max_bad_fraction=1.5", r"data\.max_bad_fraction must be in \[0, 1\], got 1\.5"),
        ("data.num_proc=0", r"data\.num_proc must be >= 1, got 0"),
        ("data.verify_images=decode", r"data\.verify_images: got 'decode'"),
        ("data.fingerprint=mtime", r"data\.fingerprint: got 'mtime'"),
        ("data.tiny_task=speech", r"data\.tiny_task: got 'speech'"),
    ],
)
def test_out_of_range(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=[override])


def test_the_tone_task_is_refused_for_an_objective_that_reads_pairs():
    with pytest.raises(ConfigError, match=r"data\.tiny_task='tones' is a conversation task; train\.objective='dpo' reads pairs"):
        config.load(overrides=["data.tiny_task=tones", "train.objective=dpo"])


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen2_5_omni", "qwen3_omni_moe"])
def test_audio_in_video_needs_a_family_that_hears(name):
    """``data.use_audio_in_video=true`` is read by the Omni families (tests/data/test_audio_rows.py) and refused,
    before any process starts, for a family without an audio tower."""
    overrides = ["data.use_audio_in_video=true", f"model.name={name}"]
    if "omni" in name:
        assert config.load(overrides=overrides).data.use_audio_in_video
        return
    with pytest.raises(ConfigError, match=r"data\.use_audio_in_video=true hears each video's audio track, but "
                                          r"model\.name='qwen2_5_vl' has no audio tower"):  # fmt: skip
        config.load(overrides=overrides)


@pytest.mark.parametrize("overrides", [["train.objective=grpo"], ["data.eval_fraction=0.1"]], ids=["grpo", "eval"])
def test_audio_in_video_goes_with_generation(overrides):
    """GRPO's rollouts and eval_accuracy's replies generate with it (tests/engine/generation/test_generate.py places
    a heard video as HF's class does; tests/engine/objectives/test_grpo.py trains on one)."""
    assert config.load(overrides=["data.use_audio_in_video=true", "model.name=qwen2_5_omni", *overrides]).data.use_audio_in_video
