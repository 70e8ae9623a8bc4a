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


@pytest.mark.parametrize("keys", [["lora.r=4"], ["parallel.nproc=2", "parallel.sp_size=2"], ["parallel.nproc=2", "parallel.ep_size=2"]])
def test_mtp_training_takes_lora_sp_and_ep(keys):
    """LoRA, Ulysses SP and EP run through the MTP layer (tests/model/families/test_mtp.py): no rule refuses them."""
    assert config.load(overrides=["model.mtp.train=true", *keys]).model.mtp.train


@pytest.mark.parametrize("keys, said", [
    (["loss.chunk=false"], r"model\.mtp\.train needs loss\.chunk=true"),
    (["train.objective=dpo"], r"model\.mtp\.train: train\.objective='dpo' has no MTP loss"),
    (["model.mtp.loss_weight=0"], r"model\.mtp\.loss_weight must be > 0 when model\.mtp\.train, got 0"),
])  # fmt: skip
def test_mtp_training_refuses_what_has_no_mtp_loss(keys, said):
    with pytest.raises(ConfigError, match=said):
        config.load(overrides=["model.mtp.train=true", *keys])
