"""qwenkit: fine-tune Qwen's multimodal models with PyTorch FSDP2 (chunked loss head, fused ops, notebooks).

Seven families, one entry each in :data:`qwenkit.model.families.registry.FAMILIES` (whose names only ``qwenkit/model/``
spells): Qwen2.5-VL, Qwen3-VL dense and MoE, Qwen3.5 dense and MoE, the Qwen-Omni thinkers.
"""

__version__ = "0.1.0"
