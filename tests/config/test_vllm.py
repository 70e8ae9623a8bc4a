"""qwenkit.config.vllm: the vLLM engine's settings, and what asking for vLLM is refused with before any process starts."""

import re

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
        (["train.objective=grpo", "grpo.vllm_importance_sampling_clip_max=0"], r"vllm_importance_sampling_clip_max must be > 0"),
        (["train.objective=grpo", "grpo.vllm_importance_sampling_clip_min=4"], r"vllm_importance_sampling_clip_min must be in"),
        (["train.objective=grpo", "grpo.vllm_importance_sampling_mode=token"], r"grpo\.vllm_importance_sampling_mode"),
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
