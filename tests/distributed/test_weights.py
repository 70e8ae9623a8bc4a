"""qwenkit.distributed.weights: checkpoint names in both Qwen2.5-VL layouts map to the model's keys; the
rows read from the safetensors files are ``from_pretrained``'s tensors; a shape or a tensor the model
needs and the files lack is named (file, key); one process (the 2-rank sharded read: distributed/test_fsdp.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

from qwenkit.distributed import weights


def test_model_key_maps_the_hub_layout_and_keeps_the_in_memory_one():
    hub = {
        "visual.blocks.0.attn.qkv.weight": "model.visual.blocks.0.attn.qkv.weight",
        "model.layers.1.mlp.up_proj.weight": "model.language_model.layers.1.mlp.up_proj.weight",
        "model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
    }
    for file_key, model_key in hub.items():
        assert weights.model_key(file_key) == model_key
        assert weights.model_key(model_key) == model_key  # transformers 4.52+'s layout is the model's
    assert weights.model_key("lm_head.weight") == "lm_head.weight"


@pytest.fixture(scope="module")
def reference(tiny_path):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_path).state_dict()


def test_rows_read_are_the_tensors_from_pretrained_loads(tiny_path, reference):
    files = weights.tensor_files(tiny_path)
    assert {weights.model_key(k) for k in files} == set(reference)  # every model tensor, in one layout or the other
    targets = {k: torch.zeros_like(reference[weights.model_key(k)]) for k in files}
    weights.read_slices(targets, files)
    for key, target in targets.items():
        torch.testing.assert_close(target, reference[weights.model_key(key)], rtol=0, atol=0, msg=key)
    key = next(iter(files))
    with pytest.raises(ValueError, match=rf"{files[key]}: tensor '{key}' has shape \[.*\], the model's is \[3\]"):
        weights.read_slices({key: torch.zeros(3)}, files)


def test_load_fills_a_model_and_names_what_the_files_lack(tiny_path, reference, tmp_path):
    model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(tiny_path))
    assert weights.load_hf_weights(model, tiny_path) == len(reference)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)

    with pytest.raises(FileNotFoundError, match=r"model.path='.*': no \*.safetensors weights found"):
        weights.load_hf_weights(model, tmp_path)
    (file,) = sorted(tiny_path.glob("*.safetensors"))  # the tiny checkpoint: one file
    tensors = load_file(file)
    dropped = next(k for k in tensors if "merger" in k)
    shutil.copytree(tiny_path, tmp_path / "lacking", ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != dropped}, tmp_path / "lacking" / file.name, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=f"the checkpoint lacks {weights.model_key(dropped)}"):
        weights.load_hf_weights(model, tmp_path / "lacking")
