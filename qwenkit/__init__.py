"""qwenkit: fine-tune Qwen2.5-VL with PyTorch FSDP2 (chunked loss head, fused ops, notebooks)."""

__version__ = "0.1.0"
