"""The subclass declared as its HF parent (:mod:`qwenkit.model.families.subclass`): its forward's signature, and
what transformers reads from a class's module (custom code or not, whether its attention and experts
implementations can be set) answered as the parent answers."""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
import sys

import torch
from conftest import EVERY_FAMILY
from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

from qwenkit.model.families import qwen2_5_vl
from qwenkit.model.families import registry as families


def test_declared_forward_keeps_the_parents_kwargs_annotation():
    """HF's suite reads output_attentions support from ``**kwargs: Unpack[TransformersKwargs]``."""
    ours = inspect.signature(qwen2_5_vl.QwenkitQwen2_5_VL.forward).parameters["kwargs"]
    parent = inspect.signature(Qwen2_5_VLForConditionalGeneration.forward).parameters["kwargs"]
    assert ours.kind is inspect.Parameter.VAR_KEYWORD and ours.annotation == parent.annotation
    assert ours.annotation is not inspect.Parameter.empty


@EVERY_FAMILY
def test_declared_forward_returns_the_parents_output(family):
    """HF's suite reads the fields a head returns (``router_logits`` of a MoE: test_moe_models_record_router_logits)
    from ``forward.__annotations__["return"]``; the forward returns the parent's output class."""
    entry = families.get(family)
    hf, ours = entry.load("hf_class"), entry.load("subclass")
    want = hf.forward.__annotations__.get("return")
    assert want is not None and ours.forward.__annotations__.get("return") == want
    assert inspect.signature(ours.forward).return_annotation == inspect.signature(hf.forward).return_annotation


@EVERY_FAMILY
def test_weights_missing_from_a_checkpoint_are_initialised_as_the_parents_are(family, family_path):
    """``from_pretrained`` of a checkpoint without any weight: HF's ``_init_weights`` sets each as it does on the
    parent, bit for bit from one seed (as custom code, Qwen4-Exp's PLE conv1d kept torch's default init and
    its routers the generic linear one: HF's test_can_init_all_missing_weights)."""
    entry = families.get(family)
    config = AutoConfig.from_pretrained(family_path)
    states = []
    for cls in (entry.load("hf_class"), entry.load("subclass")):
        torch.manual_seed(0)
        states.append(cls.from_pretrained(None, config=copy.deepcopy(config), state_dict={}).state_dict())
    want, got = states
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_implementations_can_be_set_as_on_the_parent_whichever_class_is_asked_first():
    """transformers answers ``_can_set_experts_implementation`` from the class's module source and caches it on the
    class: asked first (a fresh process), the subclass answered from the family module (False: no
    ``@use_experts_implementation`` there) and ``experts_implementation=`` was refused."""
    probe = (
        "import json; from qwenkit.model.families import registry as f\n"
        "out = {}\n"
        "for n in f.FAMILIES:\n"
        "    e = f.get(n)\n"
        "    if e.unavailable(): continue\n"
        "    ours, hf = e.load('subclass'), e.load('hf_class')\n"
        "    for p in ('_can_set_experts_implementation', '_can_set_attn_implementation', 'is_custom_code'):\n"
        "        if hasattr(hf, p): out[f'{n}.{p}'] = [getattr(ours, p)(), getattr(hf, p)()]\n"
        "print(json.dumps(out))\n"
    )
    answers = json.loads(subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout)
    assert answers and {k: v for k, v in answers.items() if v[0] != v[1]} == {}
