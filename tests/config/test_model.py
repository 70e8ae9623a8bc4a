"""qwenkit.config.model: fused ops by name, and a fused backend refused without its library."""

import pytest

from qwenkit import config
from qwenkit.config import ConfigError


def test_unknown_fused_op():
    with pytest.raises(ConfigError, match=r"model\.fused_ops: unknown fused op 'gelu'"):
        config.load(overrides=["model.fused_ops=[rms_norm, gelu]"])


def test_fused_backend_is_refused_without_its_library(monkeypatch):
    monkeypatch.setattr(config.model, "installed", lambda library: library == "torch_npu")
    with pytest.raises(ConfigError, match=r"model\.fused_backend='cuda' needs liger-kernel, which is not installed"):
        config.load(overrides=["model.fused_backend=cuda"])
    assert config.load(overrides=["model.fused_backend=cuda", "model.fused_ops='off'"]).model.fused_backend == "cuda"
    assert config.load(overrides=["model.fused_backend=npu"]).model.fused_backend == "npu"
    with pytest.raises(ConfigError, match=r"model\.fused_backend"):
        config.load(overrides=["model.fused_backend=tpu"])
