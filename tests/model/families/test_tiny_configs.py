"""qwenkit.model.families.tiny_configs: the tiny checkpoints' configs (their architecture: tests/model/tiny/test_checkpoint.py)."""

import json

from conftest import AUDIO_FAMILY

from qwenkit.data import audio
from qwenkit.model.families import registry as families


@AUDIO_FAMILY
def test_a_tiny_thinker_places_time_at_the_rate_its_processor_writes_it(family, family_path):
    """A video heard with its audio track is written with its pads interleaved by time at the processor's
    position ids per second (:func:`qwenkit.data.audio.video_span`, HF's own method) and placed by the thinker's
    ``get_rope_index`` at its config's: the two must be one rate (Qwen2.5-Omni 25, Qwen3-Omni 13; transformers'
    config default is 25 for both), or the tiny model trains on positions no real checkpoint has."""
    config = json.loads((family_path / "config.json").read_text())
    config = config.get("thinker_config", config)
    processor = audio._processing(families.get(family))
    (cls,) = (getattr(processor, n) for n in processor.__all__ if n.endswith("Processor"))
    assert config["position_id_per_seconds"] == cls.position_id_per_seconds
