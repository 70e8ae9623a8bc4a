"""qwenkit.model.families.omni: the thinker's own parts (the chunk loss = HF for audio: test_chunked.py; for videos heard
with their audio track: here), and the thinker read from a whole Omni checkpoint."""

import pytest
import torch
from conftest import AUDIO_FAMILY, build_model, make_batch, tiny_checkpoint, tiny_processor
from safetensors.torch import load_file

from qwenkit.bench.step import loss_and_grads
from qwenkit.data import Collator
from qwenkit.distributed import weights
from qwenkit.model.families import registry as families
from qwenkit.model.families import spec as model_spec
from qwenkit.model.families.entry import text_config
from tests.data.test_audio_rows import HEARD_ROW, _read, write_heard_set
from tests.data.test_audio_rows import write_png as _write_png

FP32 = dict(rtol=1e-5, atol=1e-7)  # fp32 both sides; the chunked head sums in another order (test_chunked.py)
# a row without a video: an image and an audio (its positions must not move when a heard video shares the batch)
UNHEARD_ROW = {"messages": [{"role": "user", "content": "<image><audio>Which shape, which tone?"},
                            {"role": "assistant", "content": "A square, low."}], "images": ["i.png"], "audios": ["a.wav"]}  # fmt: skip


@AUDIO_FAMILY
def test_a_rank_without_audio_runs_the_audio_tower_idle_under_data_parallel(_cache, family):
    """With the trainer's vision padding on (data parallel), a batch without audio adds 0 x the audio
    tower: the loss is unchanged and every audio parameter the tower uses gets a (zero) gradient, as the
    root's reduce-scatter on a rank with audio expects; without padding (one process) nothing is added."""
    model = build_model(chunk=True, seed=1, name=family)
    batch = make_batch(tiny_processor(family), images_per_sample=(1, 0))
    alone, alone_grads = loss_and_grads(model, batch)
    assert not any(n.startswith("model.audio_tower") for n in alone_grads)
    model.vision_calls_per_step = 1
    padded, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(padded, alone, rtol=0, atol=0)
    audio = [n for n, _ in model.named_parameters() if n.startswith("model.audio_tower.") and "bos_eos" not in n]
    assert len(audio) > 10 and all(n in grads and not grads[n].any() for n in audio)


@AUDIO_FAMILY
def test_video_seconds_reach_the_thinker_under_its_name(_cache, family):
    model = build_model(chunk=False, name=family)
    kwargs = model._drop_unsupported({"second_per_grid_ts": torch.tensor([1.0]), "mm_token_type_ids": None})
    assert set(kwargs) == {"video_second_per_grid"}


def _heard_batch(tmp_path, family, rows):
    write_heard_set(tmp_path)
    _write_png(tmp_path / "i.png", (56, 84))
    dataset, report = _read(tmp_path, rows, family, use_audio_in_video=True)
    assert report.skipped == 0
    collate = Collator(tiny_processor(family))
    batches = [collate([dataset[i] for i in range(len(rows))])] + [collate([dataset[i]]) for i in range(len(rows))]
    for batch in batches:
        batch.pop("num_samples")
    return batches


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, **FP32)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], **FP32, msg=lambda m, n=name: f"{n}: {m}")


@AUDIO_FAMILY
@pytest.mark.parametrize("rows", [[HEARD_ROW], [HEARD_ROW, UNHEARD_ROW]], ids=["heard", "mixed"])
def test_a_heard_video_batch_has_hfs_loss_and_every_gradient(_cache, tmp_path, family, rows):
    """A batch from the data pipeline with ``data.use_audio_in_video`` (the video's span interleaved with its
    track's pads, the track's features first): the chunk loss and every gradient (fp32) equal HF's own forward
    called with ``use_audio_in_video=True``, the flag the thinker reads off the ids itself (no batch key says
    it). ``mixed``: one row hears a video, one has an image and an audio and no video (VeOmni #493: one flag for
    the batch); the audio, vision and decoder gradients all come from both rows."""
    batch, *_ = _heard_batch(tmp_path, family, rows)
    count = batch.pop("num_items")
    hf, ours = build_model(chunk=False, seed=1, name=family), build_model(chunk=True, seed=1, name=family)
    assert ours.heard_videos(batch["input_ids"])
    reference = loss_and_grads(hf, batch, use_audio_in_video=True, num_items_in_batch=count)
    seen = []  # the positions the decoder gets: at the tiny model's random weights they move the loss little
    hook = ours.model.language_model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(kwargs["position_ids"]), with_kwargs=True)  # fmt: skip
    _assert_same(reference, loss_and_grads(ours, batch, num_items_in_batch=count))
    hook.remove()
    want, _ = hf.model.get_rope_index(batch["input_ids"], batch.get("image_grid_thw"), batch["video_grid_thw"],
                                      batch["attention_mask"], True, batch["feature_attention_mask"].sum(1),
                                      batch["second_per_grid_ts"])  # fmt: skip
    torch.testing.assert_close(seen[0][-3:].float(), want.float(), rtol=0, atol=0)
    assert any(n.startswith("model.audio_tower") for n in reference[1])


@AUDIO_FAMILY
def test_a_row_without_a_video_keeps_its_loss_beside_a_heard_video(_cache, tmp_path, family):
    """The mixed batch's loss is the sum of its rows' losses taken alone over the same token count: the row
    without a video, run alone without ``use_audio_in_video``, is placed as in the batch that has the flag on
    (HF's ``get_rope_index`` reads the flag for videos only). The router's aux loss is left out (not a sum)."""
    mixed, *alone = _heard_batch(tmp_path, family, [HEARD_ROW, UNHEARD_ROW])
    count = mixed.pop("num_items")
    model = build_model(chunk=True, seed=3, name=family)
    with torch.no_grad():
        total = model(**mixed, num_items_in_batch=count, output_router_logits=False).loss
        rows = []
        for one in alone:
            one.pop("num_items")
            rows.append(model(**one, num_items_in_batch=count, output_router_logits=False).loss)
    assert not model.heard_videos(alone[1]["input_ids"])
    torch.testing.assert_close(total, torch.stack(rows).sum(), rtol=1e-5, atol=1e-6)


@AUDIO_FAMILY
def test_a_heard_video_has_hfs_sequence_logps(_cache, tmp_path, family):
    """DPO's log-probs (the head's other path, ``sequence_logps``) of the mixed batch equal the full-logits
    log-probs of HF's forward with ``use_audio_in_video=True`` (fp32)."""
    from qwenkit.model.losses.logps import full_sequence_logps

    batch, *_ = _heard_batch(tmp_path, family, [HEARD_ROW, UNHEARD_ROW])
    batch.pop("num_items")
    model = build_model(chunk=True, seed=2, name=family)
    with torch.no_grad():
        got, _ = model.sequence_logps(**batch, output_router_logits=False)
        model.chunk_loss = False
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_audio_in_video=True,
                       use_cache=False, output_router_logits=False).logits  # fmt: skip
    torch.testing.assert_close(got, full_sequence_logps(logits, batch["labels"])[0], **FP32)


@AUDIO_FAMILY
def test_what_hfs_forward_never_reads_is_frozen_at_build(_cache, family):
    """Qwen2.5-Omni's audio_bos_eos_token gets no gradient in HF's forward: left trainable, AdamW holds no
    state for it and a resumed run fails on the missing key (test_dcp's every-family resume)."""
    model = build_model(name=family)
    never = families.get(family).never_trained
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == [f"{path}.weight" for path in never]


@AUDIO_FAMILY
@pytest.mark.parametrize("whole", [False, True], ids=["thinker", "whole"])
def test_the_thinker_is_read_from_its_own_checkpoint_and_from_the_whole_omni_one(_cache, family, whole):
    """``model.path`` at a full Omni checkpoint (thinker, talker, vocoder; what users start from): ``auto``
    is the thinker's family, the build is the thinker alone with the weights HF's class of the whole loads
    into its ``thinker``, and so does the meta path's reader (``load_hf_weights``: Qwen3-Omni's experts are
    stored per linear, fused as HF fuses them); the config checks read the thinker's text config. A
    thinker-only checkpoint reads the same way."""
    path, entry = tiny_checkpoint(family, whole=whole), families.get(family)
    spec = model_spec.resolve("auto", path)
    assert spec.family.name == family and spec.whole == whole
    assert spec.model_config["model_type"] == entry.model_type
    if whole:
        reference = entry.whole.load("hf_class").from_pretrained(path).thinker.state_dict()
        assert len(load_file(path / "model.safetensors")) > len(reference)  # the talker's and the vocoder's too
    else:
        reference = entry.load("hf_class").from_pretrained(path).state_dict()
    model = build_model(name="auto", path=str(path))
    assert model.state_dict().keys() == reference.keys()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    assert text_config(entry, path)["hidden_size"] == model.config.text_config.hidden_size
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    weights.load_hf_weights(model, path)
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
