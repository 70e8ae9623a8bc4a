"""The subclass declared as its HF parent (:mod:`qwenkit.model.families.subclass`): its forward's signature."""

from __future__ import annotations

import inspect

from transformers import Qwen2_5_VLForConditionalGeneration

from qwenkit.model.families import qwen2_5_vl


def test_declared_forward_keeps_the_parents_kwargs_annotation():
    """HF's suite reads output_attentions support from ``**kwargs: Unpack[TransformersKwargs]``."""
    ours = inspect.signature(qwen2_5_vl.QwenkitQwen2_5_VL.forward).parameters["kwargs"]
    parent = inspect.signature(Qwen2_5_VLForConditionalGeneration.forward).parameters["kwargs"]
    assert ours.kind is inspect.Parameter.VAR_KEYWORD and ours.annotation == parent.annotation
    assert ours.annotation is not inspect.Parameter.empty
