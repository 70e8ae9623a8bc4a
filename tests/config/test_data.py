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
        ("data.use_audio_in_video=true", r"data\.use_audio_in_video=true: a video's audio track .* not made equal"),
        ("data.tiny_task=speech", r"data\.tiny_task: got 'speech'"),
    ],
)
def test_out_of_range(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        config.load(overrides=[override])


def test_the_tone_task_is_refused_for_an_objective_that_reads_pairs():
    with pytest.raises(ConfigError, match=r"data\.tiny_task='tones' is a conversation task; train\.objective='dpo' reads pairs"):
        config.load(overrides=["data.tiny_task=tones", "train.objective=dpo"])
