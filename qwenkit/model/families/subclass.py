"""A family's subclass made to look like its HF parent: the parent's forward signature and checkpoint format.

A family module declares ``class QwenkitX(ChunkLossMixin, XForConditionalGeneration)`` and then
calls :func:`finish_subclass` on it (``model/families/qwen2_5_vl.py``); the chunk-loss forward itself is
:class:`qwenkit.model.families.chunked.ChunkLossMixin`'s.
"""

from __future__ import annotations

import inspect

from qwenkit.model.families.chunked import ChunkLossMixin

# the keywords ChunkLossMixin.forward takes beside the parent's parameters
OWN_KEYWORDS = ("return_dict", "num_items_in_batch", "num_samples", "packed_seq_lens", "loss_type")


def finish_subclass(cls: type, parent: type) -> type:
    """Declare the parent's forward signature on ``cls`` and give it the parent's checkpoint format.

    HF's ``generate`` checks its model kwargs (``pixel_values``, ``video_grid_thw``, ...) against
    ``inspect.signature(model.forward)`` and refuses any it does not find there; HF's test suite
    reads it to pick tests (``inputs_embeds``) and the outputs a head returns. Declaring the parent's signature (self, the
    parent's parameters, qwenkit's keywords, the parent's annotated ``**kwargs``) keeps both
    working on every transformers version without copying its parameter list.
    """
    parent_sig = inspect.signature(parent.forward).parameters
    cls._parent_params = [
        p for name, p in parent_sig.items() if name != "self" and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]

    def forward(self, *args, **kwargs):
        return ChunkLossMixin.forward(self, *args, **kwargs)

    own = inspect.signature(ChunkLossMixin.forward).parameters
    extra = [own[n].replace(kind=inspect.Parameter.KEYWORD_ONLY) for n in OWN_KEYWORDS]
    # the parent's **kwargs keeps its annotation (Unpack[TransformersKwargs]): HF's suite reads
    # output_attentions / output_hidden_states support from it
    parent_kwargs = next(p for p in parent_sig.values() if p.kind is inspect.Parameter.VAR_KEYWORD)
    forward.__signature__ = inspect.Signature(
        [own["self"], *cls._parent_params, *extra, parent_kwargs],
        return_annotation=inspect.signature(parent.forward).return_annotation,
    )
    # the parent's annotations, its return type among them: HF's suite reads which outputs a head returns
    # (``router_logits``) from ``forward.__annotations__["return"]``, and the forward returns the parent's output
    forward.__annotations__ = dict(parent.forward.__annotations__)
    forward.__doc__ = ChunkLossMixin.forward.__doc__
    forward.__qualname__ = f"{cls.__qualname__}.forward"
    cls.forward = forward
    _inherit_library_facts(cls, parent)
    _register_checkpoint_format(cls, parent)
    return cls


def _inherit_library_facts(cls: type, parent: type) -> None:
    """Give the subclass the parent's answers to what transformers 5.x reads from a class's module.

    The subclass is HF's model with a forward wrapped around it: every module and ``_init_weights`` is
    the parent's. transformers guesses otherwise from where the class is defined:

    - ``is_custom_code()`` (the module is outside ``transformers.``): ``initialize_weights`` then skips
      a module whose own parameters are all set, before its ``_init_weights`` runs, so a parent's init of
      a child's weight never happens: ``from_pretrained`` of a checkpoint without Qwen4-Exp's PLE
      ``conv1d`` left it at torch's default init instead of HF's zeros, and the MoE router ``gate`` at
      the generic linear init instead of the block's own (HF's test_can_init_all_missing_weights);
    - ``_can_set_experts_implementation()`` / ``_can_set_attn_implementation()`` grep the class's module
      source (``@use_experts_implementation``), which the family module does not contain: the answer
      depended on whether the parent had been asked first (``experts_implementation=`` refused).
    """
    cls.is_custom_code = classmethod(lambda _cls: parent.is_custom_code())
    for probe in ("_can_set_attn_implementation", "_can_set_experts_implementation"):
        if hasattr(parent, probe):  # transformers 4.57 has neither
            setattr(cls, f"{probe}_cached_value", getattr(parent, probe)())


def _register_checkpoint_format(cls: type, parent: type) -> None:
    """Give the subclass HF's key conversions, so old-layout checkpoints (``visual.*``, ``model.*``
    keys) load and export like the parent's, wherever the class is imported from.

    transformers 5.x treats classes outside its package as custom code and skips the
    parent's legacy-key mapping unless the class is registered; 4.57 inherits the class
    attribute ``_checkpoint_conversion_mapping`` and needs nothing.
    """
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:
        return
    # keyed by the class (Qwen2.5-VL's legacy keys) or by its model_type (Qwen3-VL-MoE's expert transpose)
    mapping = get_checkpoint_conversion_mapping(parent.__name__) or get_checkpoint_conversion_mapping(
        parent.config_class.model_type
    )
    if mapping is not None:
        register_checkpoint_conversion_mapping(cls.__name__, mapping, overwrite=True)
