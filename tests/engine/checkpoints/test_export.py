"""``qwenkit export`` and ``qwenkit eval`` of what users deploy: the export's processor resizes as
the run did, the target folder is never mixed or lost, and every subcommand's bad input is one
line and exit status 2.

One short run (1 step, in this process) trained with image bounds other than the base model's
and other than the config defaults, so a processor that forgets them gives other image tokens.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import AUDIO_FAMILY, EVERY_FAMILY, tiny_checkpoint
from multiproc import scaled
from PIL import Image
from transformers.video_utils import VideoMetadata

from qwenkit import cli
from qwenkit import config as qconfig
from qwenkit.data.report import Location
from qwenkit.data.video import RULES, VideoMeta
from qwenkit.engine.checkpoints import dcp as ckpt
from qwenkit.engine.checkpoints import export as hf_export
from qwenkit.engine.generation import eval_command
from qwenkit.engine.run import train
from qwenkit.model.families import registry as families
from qwenkit.model.paths import load_processor, resolve_path
from qwenkit.model.processor import ImageProcessor, pixel_bounds

ROOT = Path(__file__).resolve().parents[2]
# the run's bounds: 300x168 is 50 image tokens here, 10 under the tiny base's 3136..12544 and
# 66 under the config defaults (3136..200704)
RUN = ["data.min_pixels=6272", "data.max_pixels=50176", "train.steps=1", "data.tiny_samples=4", "data.tiny_eval_samples=2",
       "train.eval_samples=0", "train.micro_batch_size=2", "train.resume=none", "train.warmup_steps=1", "data.video_fps=1.5",
       "data.video_max_frames=16", "data.video_max_pixels=12544"]  # fmt: skip


@pytest.fixture(autouse=True)
def _no_root_handler(monkeypatch):
    """cli.main in this process: its logging.basicConfig would bind the root logger to capsys's stream."""
    monkeypatch.setattr("logging.basicConfig", lambda **k: None)


def _our_lines(err: str, command: str) -> list[str]:
    """The command's own lines on stderr (not the logged warnings beside them)."""
    return [line for line in err.splitlines() if line.startswith(f"qwenkit {command}")]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("export") / "run"
    cfg = qconfig.load(overrides=[*RUN, f"train.output_dir={out}"])
    train.run(cfg)
    qconfig.write_config(cfg, out)  # what qwenkit train writes before starting the ranks
    return out


def _image(seed=0, size=(300, 168)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _grid_and_pixels(image_processor, image):
    out = image_processor(images=[image], return_tensors="pt")
    return out["image_grid_thw"], out["pixel_values"]


def test_exported_processor_resizes_as_training_did(run, tmp_path):
    cfg = qconfig.load(run / "config.yaml")
    exported = hf_export.export(run, tmp_path / "hf", cfg)
    saved = json.loads((exported / "preprocessor_config.json").read_text())
    assert saved["size"] == {"shortest_edge": 6272, "longest_edge": 50176}
    assert (saved["min_pixels"], saved["max_pixels"]) == (6272, 50176)

    training = load_processor(cfg).image_processor  # what the run's data pipeline used
    image = _image()
    grid, pixels = _grid_and_pixels(training, image)
    assert training.merge_size == 2 and int(grid.prod()) // 4 == 50
    base = ImageProcessor.from_pretrained(resolve_path(cfg.model), local_files_only=True)
    assert not torch.equal(_grid_and_pixels(base, image)[0], grid)  # the base's own bounds differ

    # HF's class, as a user loads it from the export: no bounds passed
    hf = ImageProcessor.from_pretrained(exported, local_files_only=True)
    assert pixel_bounds(hf) == (6272, 50176)
    hf_grid, hf_pixels = _grid_and_pixels(hf, image)
    torch.testing.assert_close(hf_grid, grid, rtol=0, atol=0)
    torch.testing.assert_close(hf_pixels, pixels, rtol=0, atol=0)  # same class, same settings: same bits
    from transformers import AutoImageProcessor

    auto = AutoImageProcessor.from_pretrained(exported, local_files_only=True)
    auto_grid, auto_pixels = _grid_and_pixels(auto, image)
    torch.testing.assert_close(auto_grid, grid, rtol=0, atol=0)
    # a torchvision ("fast") class where one is installed resizes with other kernels: normalised
    # pixels in about [-1.8, 2.2], a resampling difference of a few 1/255 steps
    same_class = type(auto) is type(training)
    torch.testing.assert_close(auto_pixels, pixels, rtol=0, atol=0 if same_class else 0.1)

    # qwenkit eval of the export, with no --config: the export's bounds, not the config defaults
    model, processor, eval_cfg, _ = eval_command.load_for_eval(exported)
    assert (eval_cfg.data.min_pixels, eval_cfg.data.max_pixels) == (6272, 50176)
    assert qconfig.load(exported / hf_export.RUN_CONFIG) == cfg  # the run's config travels with its export:
    assert eval_cfg.data.tiny_eval_samples == 2  # its eval set too (the defaults have none)
    eval_grid, eval_pixels = _grid_and_pixels(processor.image_processor, image)
    torch.testing.assert_close(eval_grid, grid, rtol=0, atol=0)
    torch.testing.assert_close(eval_pixels, pixels, rtol=0, atol=0)


def test_video_sampling_goes_into_the_exported_video_processor(tmp_path):
    cfg = qconfig.load(overrides=RUN)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen2VLVideoProcessor", "fps": 2.0, "min_frames": 4, "max_frames": 768,
        "size": {"shortest_edge": 100352, "longest_edge": 602112}, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2,
    }))  # fmt: skip
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": {"size": {}}, "processor_class": "x"}))
    hf_export.write_run_processing(tmp_path, cfg.data, families.get("qwen2_5_vl"))
    video = json.loads((tmp_path / "video_preprocessor_config.json").read_text())
    assert video["size"] == {"shortest_edge": 6272, "longest_edge": 12544}
    assert (video["fps"], video["min_frames"], video["max_frames"], video["do_sample_frames"]) == (1.5, 4, 16, True)
    nested = json.loads((tmp_path / "processor_config.json").read_text())["image_processor"]
    assert nested["size"] == {"shortest_edge": 6272, "longest_edge": 50176}
    try:
        from transformers import Qwen2VLVideoProcessor

        loaded = Qwen2VLVideoProcessor.from_pretrained(tmp_path, local_files_only=True)
    except ImportError:  # the video processor needs torchvision, an optional install
        return
    assert (loaded.fps, loaded.min_frames, loaded.max_frames) == (1.5, 4, 16)
    assert (loaded.size["shortest_edge"], loaded.size["longest_edge"]) == (6272, 12544)


# (frames, fps, width, height) of clips whose size each bound decides, under RUN's sampling (1.5 fps,
# at most 16 frames) and the test's bounds: 5 frames get data.video_max_pixels each, 12 frames the
# total's share (100352 // 12), 16 frames the floor 1.05 · min_pixels, and the small clip the
# volume's lower bound
CLIPS = [(35, 10, 640, 360), (240, 30, 640, 360), (1200, 24, 1280, 720), (8, 2, 40, 32)]


@EVERY_FAMILY
def test_exported_video_processor_samples_and_resizes_as_training_did(family, family_path, family_processor, tmp_path):
    """A base without a video config (the tiny models) gets one in its family's HF class, and HF's
    video processor loaded from the export samples the frames and sizes the grid of qwenkit's rule
    (Qwen3-VL: a volume bound, the per-frame share by ``cap_pixels_per_frame``)."""
    cfg = qconfig.load(overrides=RUN + ["data.video_total_pixels=100352"])
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        if (family_path / name).is_file():
            (tmp_path / name).write_bytes((family_path / name).read_bytes())
    assert not (tmp_path / "video_preprocessor_config.json").exists()
    fam = families.get(family)
    hf_export.write_run_processing(tmp_path, cfg.data, fam)
    rule = RULES[fam.video_rule]
    written = json.loads((tmp_path / "video_preprocessor_config.json").read_text())
    assert written["video_processor_type"] == rule.hf_class and written["fps"] == 1.5
    ours = rule.from_config(family_processor.image_processor, cfg.data)
    assert written["patch_size"] == ours.patch and written["merge_size"] == ours.merge
    try:  # Qwen2-VL's video processor imports torchvision, an optional install
        hf = getattr(transformers, rule.hf_class).from_pretrained(tmp_path, local_files_only=True)
    except ImportError:
        pytest.skip(f"{rule.hf_class} needs torchvision")
    if not hasattr(hf, "get_num_of_video_patches"):
        pytest.skip(f"this transformers' {rule.hf_class} has no per-frame cap (4.57): the total alone bounds it")
    for frames, fps, w, h in CLIPS:
        plan = ours.plan(VideoMeta(frames=frames, fps=float(fps), width=w, height=h), Location("clip.mp4"), "v")
        indices = hf.sample_frames(VideoMetadata(total_num_frames=frames, fps=float(fps))).tolist()
        assert list(plan.indices) == indices, (frames, fps)
        assert math.prod(plan.grid) == hf.get_num_of_video_patches(len(indices), h, w), (frames, fps, w, h)


def test_export_never_mixes_or_loses_a_folder(run, tmp_path, capsys):
    cfg = qconfig.load(run / "config.yaml")
    target = tmp_path / "hf"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(hf_export.ExportError, match=r"is not empty; pass --overwrite"):
        hf_export.export(run, target, cfg)
    with pytest.raises(hf_export.ExportError, match=r"holds files but no export"):
        hf_export.export(run, target, cfg, overwrite=True)  # not a previous export: left alone
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    (target / "notes.txt").unlink()
    hf_export.export(run, target, cfg)  # empty: fine
    (target / "stale.bin").write_text("from an older export")
    hf_export.export(run, target, cfg, overwrite=True)
    assert not (target / "stale.bin").exists() and (target / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left beside it
    with pytest.raises(hf_export.ExportError, match=r"is the run's own output_dir"):
        hf_export.export(run, run, cfg, overwrite=True)
    with pytest.raises(hf_export.ExportError, match=r"inside the run's checkpoints"):
        hf_export.export(run, run / "checkpoints" / "hf", cfg)
    (tmp_path / "file").write_text("")
    with pytest.raises(hf_export.ExportError, match=r"is a file"):
        hf_export.export(run, tmp_path / "file", cfg)
    assert not (run / "config.json").exists()
    # through the command line: one line, exit 2; --overwrite
    assert cli.main(["export", str(run), str(target)]) == 2
    err = capsys.readouterr().err
    (line,) = _our_lines(err, "export")
    assert line.startswith("qwenkit export: export target") and "--overwrite" in line and "Traceback" not in err
    assert cli.main(["export", str(run), str(target), "--overwrite"]) == 0


def test_eval_data_gets_the_checks_training_data_gets(run, tmp_path, capsys):
    rows = json.loads(_tiny_file().read_text())
    image_dir = _tiny_file().parent
    good = [dict(r, images=[str(image_dir / i) for i in r["images"]]) for r in rows[:4]]
    bad = [dict(r, images=[str(tmp_path / "gone.png")]) for r in rows[:4]]
    cases = {
        "broken.json": ("[{\"messages\": ", r"unreadable dataset files cannot be skipped"),
        "half_bad.json": (json.dumps(good + bad), r"4 of 8 samples \(50\.0%\) are bad, more than data\.max_bad_fraction=0\.01"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        assert cli.main(["eval", str(run), "--data", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert "Traceback" not in err and re.search(message, err), err
    assert cli.main(["eval", str(run), "--data", str(tmp_path / "missing.json")]) == 2
    assert f"qwenkit eval: --data '{tmp_path / 'missing.json'}': no such file or directory" in capsys.readouterr().err
    assert cli.main(["eval", str(run), "--samples", "-5"]) == 2
    assert "qwenkit eval: --samples must be >= 1 (rows to evaluate; leave it out for the run's train.eval_samples), " \
           "got -5" in capsys.readouterr().err
    # without --samples, a run trained with train.eval_samples=0 (no answer metrics, as this one) generates no row either
    out = tmp_path / "g.jsonl"
    assert cli.main(["eval", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == "qwenkit eval: the run's train.eval_samples=0 asks for no generated row; pass --samples N\n", err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU backend's head dims: the run would take the GPU")
def test_eval_on_vllm_of_a_head_dim_its_cpu_backend_cannot_run_is_one_line_before_anything_loads(tiny_path, tmp_path,
                                                                                                 monkeypatch, capsys):
    """The tiny default's old head dim (16) failed inside vLLM, after the start, with a 147-line traceback (issue 62)."""
    from engine.run.test_prespawn import head_dim_16
    from qwenkit.engine.generation import eval_command

    monkeypatch.setattr(qconfig, "installed", lambda library: True)  # as in the vLLM environment
    monkeypatch.setattr(eval_command, "load_for_eval", lambda *a, **k: pytest.fail("the model must not load"))
    export = head_dim_16(tiny_path, tmp_path / "export")  # an export's config.json: all eval reads before the check
    assert cli.main(["eval", str(export), "--engine", "vllm", "--samples", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qwenkit eval: --engine vllm: vLLM's CPU attention runs head dims 32, 64,") and err.count("\n") == 1


def _tiny_file() -> Path:
    from qwenkit.model.tiny.data import ensure_dataset

    return ensure_dataset(4)


def test_eval_and_export_name_what_is_wrong_in_one_line(run, tmp_path, capsys):
    tmp_ckpt = ckpt.checkpoint_root(run) / ".tmp-step-00000009"
    tmp_ckpt.mkdir()
    (tmp_path / "bad.yaml").write_text("train:\n  steps: many\n")
    cases = [
        (["eval", str(tmp_ckpt)], "qwenkit eval: ", "no complete checkpoint there"),
        (["eval", str(tmp_path / "nowhere")], "qwenkit eval: ", "no such run, checkpoint or export"),
        (["eval", str(run), "--config", str(tmp_path / "bad.yaml")], "qwenkit eval: ", "train.steps: got 'many'"),
        (["export", str(tmp_ckpt), str(tmp_path / "hf")], "qwenkit export: ", "no complete checkpoint there"),
        (["export", str(run), str(tmp_path / "hf"), "--config", str(tmp_path / "bad.yaml")], "qwenkit export: ",
         "train.steps: got 'many'"),
        (["export", str(tmp_path / "nowhere"), str(tmp_path / "hf")], "qwenkit export: ", "no complete checkpoint"),
    ]  # fmt: skip
    for argv, prefix, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        (line,) = _our_lines(err, argv[0])
        assert line.startswith(prefix) and message in line and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "hf").exists()


# Each subcommand once as users run it: `python -m qwenkit.cli`, bad input, one line, exit 2.
BAD_INPUT = {
    "train": (["train", "train.lr=fast"], "train.lr: got 'fast', expected float"),
    "data check": (["data", "check", "/nowhere/rows.json"], "no such file or directory"),
    "data prepare": (["data", "prepare", "/nowhere/rows.json"], "no such file or directory"),
    "eval": (["eval", "/nowhere/run"], "no such run, checkpoint or export"),
    "export": (["export", "/nowhere/run", "/nowhere/hf"], "no complete checkpoint there"),
    "notebooks": (["notebooks", "run", "--params", "no_such_set", "--only", "01"], "no_such_set"),
}


@pytest.mark.parametrize("command", BAD_INPUT)
def test_every_subcommand_reports_bad_input_in_one_line_with_status_2(command, tmp_path):
    if command == "notebooks":
        pytest.importorskip("papermill")
    argv, message = BAD_INPUT[command]
    proc = subprocess.run([sys.executable, "-m", "qwenkit.cli", *argv], cwd=tmp_path if command != "notebooks" else ROOT,
                          capture_output=True, text=True, timeout=scaled(600),
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = _our_lines(proc.stderr, command)
    assert message in line and "Traceback" not in proc.stderr, proc.stderr[-2000:]



@AUDIO_FAMILY
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_run_from_a_whole_omni_checkpoint_exports_the_whole_with_its_other_tensors_byte_for_byte(family, tmp_path, lora):
    """A run trains the thinker of a full Omni checkpoint (thinker, talker, token2wav or code2wav): one step,
    then the export loads in HF's class of the whole, its thinker the trained one, every other tensor the
    base's bit for bit in the base's dtype (one kept in bf16 here: not cast to the run's), and the whole's
    config, the speakers HF's class needs (Qwen2.5-Omni) and the processor files beside them; ``qwenkit eval``
    of the export evaluates its thinker. A LoRA run: ``--merge`` is that whole with the merged thinker, the
    adapter export goes onto the thinker read from the whole base (docs/CHECKPOINTS.md)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from qwenkit.model.families.spec import of_run

    entry = families.get(family)
    base = tmp_path / "base"
    shutil.copytree(tiny_checkpoint(family, whole=True), base)
    weights = load_file(base / "model.safetensors")
    others = {k: v for k, v in weights.items() if not k.startswith(entry.whole.prefix)}
    bf16 = next(k for k in others if others[k].ndim == 2)
    others[bf16] = others[bf16].to(torch.bfloat16)
    save_file(weights | others, base / "model.safetensors", metadata={"format": "pt"})
    run = tmp_path / "run"
    adapters = ["lora.r=4", "lora.alpha=8"] if lora else []
    cfg = qconfig.load(overrides=[*RUN, f"model.path={base}", f"train.output_dir={run}", "train.lr=0.01", *adapters])
    train.run(cfg)
    exported = hf_export.export(run, tmp_path / "hf", cfg, merge=lora)
    index = json.loads((exported / hf_export.INDEX).read_text())["weight_map"]
    assert others.keys() < index.keys()
    for key, value in others.items():
        with safe_open(exported / index[key], framework="pt") as f:
            got = f.get_tensor(key)
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got.flatten().view(torch.uint8), value.flatten().view(torch.uint8)), key
    whole = entry.whole.load("hf_class").from_pretrained(exported)
    trained = hf_export.load_hf(run / "checkpoints" / "step-00000001", cfg, of_run(cfg.model)).state_dict()
    thinker = whole.thinker.state_dict()
    assert thinker.keys() == trained.keys()
    assert all(torch.equal(thinker[k], v) for k, v in trained.items())
    assert any(not torch.equal(v, weights[k]) for k, v in load_file(exported / "model.safetensors").items())  # trained
    assert json.loads((exported / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    for name in (*entry.whole.files, "tokenizer.json", "preprocessor_config.json", "generation_config.json"):
        assert (exported / name).is_file(), name
    model = eval_command.load_for_eval(exported)[0]  # qwenkit eval of the whole export: its thinker
    assert type(model) is entry.load("hf_class") and all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    if lora:
        from peft import PeftModel
        from transformers import AutoConfig

        adapter = hf_export.export(run, tmp_path / "adapter", cfg)
        assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
        thinker = entry.load("hf_class").from_pretrained(base, config=AutoConfig.from_pretrained(base).thinker_config,
                                                         dtype=torch.float32)  # the run's model.dtype  # fmt: skip
        merged = PeftModel.from_pretrained(thinker, adapter).merge_and_unload().state_dict()
        for key, value in trained.items():
            torch.testing.assert_close(merged[key], value, rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")
