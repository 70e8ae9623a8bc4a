"""The families: one module per family's chunk-loss subclass, and what every family shares.

- :mod:`~qwenkit.model.families.registry`: :data:`~qwenkit.model.families.registry.FAMILIES`, the one list of families and the lookups by
  name, checkpoint or built model; :mod:`~qwenkit.model.families.entry`: what an entry holds and answers
  (its classes by import path, module paths, what it cannot run); both light (the standard library).
- :mod:`~qwenkit.model.families.spec`: a run's model resolved once (:class:`~qwenkit.model.families.spec.ModelSpec`), passed down;
  :mod:`~qwenkit.model.families.build`: the one ``build`` of a family's subclass.
- :mod:`~qwenkit.model.families.chunked`, :mod:`~qwenkit.model.families.positions`,
  :mod:`~qwenkit.model.families.subclass`: the chunk-loss forward every subclass inherits, its positions
  (mRoPE, packed rows), and the HF parent's signature declared on the subclass.
- one module per family's class: ``qwen2_5_vl``, ``qwen3_vl`` (and its MoE), ``qwen3_5`` (and its MoE,
  with ``linear_attention``: Gated DeltaNet on packed rows), ``omni`` (the thinkers).

``tiny_configs``: each family's tiny config (its real architecture at toy sizes; configuration classes only, so a
transformers without the family's modeling code still writes its tiny checkpoint). A new family is one module
here, its entry in ``registry`` and its builder in ``tiny_configs``: one folder.
"""
