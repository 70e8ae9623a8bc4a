"""qwenkit.config.vllm: the vLLM engine's settings, and what asking for vLLM is refused with before any process starts."""

import re
import socket

import pytest

from qwenkit import cli, config, launch
from qwenkit.config import ConfigError
from qwenkit.config.rules import vllm as vllm_section

ROLLOUTS = ["train.objective=grpo", "grpo.rollout_engine=vllm"]


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["vllm.gpu_memory_utilization=0"], r"vllm\.gpu_memory_utilization must be in \(0, 1\]"),
        (["vllm.cpu_kv_cache_gib=0"], r"vllm\.cpu_kv_cache_gib must be > 0"),
        (["grpo.rollout_engine=vllm"], r"^grpo\.rollout_engine set but train\.objective='sft'"),
        (["train.eval_engine=sglang"], r"train\.eval_engine"),
        (ROLLOUTS + ["lora.r=8", "lora.use_dora=true"], r"grpo\.rollout_engine=vllm does not support lora\.use_dora"),
        (["train.eval_engine=vllm", "lora.r=8", "lora.modules_to_save=[model.visual.merger]"],
         r"train\.eval_engine=vllm does not support lora\.modules_to_save"),
        (["vllm.server_timeout_s=0"], r"vllm\.server_timeout_s must be > 0"),
        (["vllm.mode=server"], r"^vllm\.mode=server, but no key asks for vLLM: set grpo\.rollout_engine=vllm"),
        (["vllm.mode=remote"], r"vllm\.mode"),
        (["vllm.server_url=http://127.0.0.1:8000"], r"is a server's address, but vllm\.mode=colocate: set vllm\.mode=server"),
        (["vllm.mode=server", "train.eval_engine=vllm", "vllm.server_url=127.0.0.1:8000"],
         r"^vllm\.server_url='127\.0\.0\.1:8000' is not http://HOST:PORT \(what `qwenkit vllm-serve` prints"),
        (["vllm.mode=server", "train.eval_engine=vllm", "vllm.server_url=http://127.0.0.1"], r"is not http://HOST:PORT"),
        (["vllm.mode=server", "train.eval_engine=vllm", "vllm.server_url=http://127.0.0.1:99999"],
         r"^vllm\.server_url='http://127\.0\.0\.1:99999' is not http://HOST:PORT \(Port out of range"),
        (["train.objective=grpo", "grpo.vllm_importance_sampling_clip_max=0"], r"vllm_importance_sampling_clip_max must be > 0"),
        (["train.objective=grpo", "grpo.vllm_importance_sampling_clip_min=4"], r"vllm_importance_sampling_clip_min must be in"),
        (["train.objective=grpo", "grpo.vllm_importance_sampling_mode=token"], r"grpo\.vllm_importance_sampling_mode"),
        (["model.name=qwen2_5_omni", "data.use_audio_in_video=true", "train.eval_engine=vllm"],
         r"^train\.eval_engine=vllm does not hand vLLM a video's audio track: set data\.use_audio_in_video=false"),
    ],
)
def test_bad_settings_are_refused(overrides, pattern):
    with pytest.raises(ConfigError) as err:
        config.load(overrides=overrides)
    assert any(re.search(pattern, p) for p in err.value.problems), err.value.problems


def test_engines_names_the_keys_that_ask_for_vllm():
    assert vllm_section.engines(config.load()) == []
    cfg = config.load(overrides=["train.eval_engine=vllm"]) if config.installed("vllm") else None
    if cfg is not None:
        assert vllm_section.engines(cfg) == ["train.eval_engine"]


def test_vllm_not_installed_is_one_line_and_exit_2_before_spawning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun must not start"))
    monkeypatch.setattr(vllm_section, "installed", lambda library: library != "vllm")  # as without vllm
    out = tmp_path / "run"
    assert cli.main(["train", *ROLLOUTS, f"train.output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grpo.rollout_engine=vllm needs vLLM, which is not installed: pip install 'qwenkit[vllm]'" in err[0]
    assert cli.main(["train", "train.eval_engine=vllm", f"train.output_dir={out}"]) == 2
    assert "train.eval_engine=vllm needs vLLM" in capsys.readouterr().err
    assert not out.exists()


def test_qwenkit_eval_engine_vllm_without_vllm_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(config, "installed", lambda library: library != "vllm")
    assert cli.main(["eval", str(tmp_path), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--engine vllm needs vLLM" in err[0]


def test_a_server_url_that_does_not_answer_is_one_line_and_exit_2_before_spawning(tiny_path, tmp_path, monkeypatch, capsys):
    """``vllm.mode=server`` with a user's ``vllm.server_url``: it must answer ``/health/`` (retried for
    ``vllm.server_timeout_s``) before any process starts; a closed port is one line naming the URL and the fix."""
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun must not start"))
    monkeypatch.setattr(vllm_section, "installed", lambda library: True)  # as with vLLM: the check after the config's
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "run"
    assert cli.main(["train", *ROLLOUTS, "vllm.mode=server", f"vllm.server_url={url}", "vllm.server_timeout_s=1",
                     f"train.output_dir={out}"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"qwenkit train: invalid run: vllm.server_url={url!r}: the vLLM server at {url} cannot be reached")
    assert "start it with `qwenkit vllm-serve --config <this run's config>`" in err[0]
    assert not (out / "logs").exists()  # no rank started
