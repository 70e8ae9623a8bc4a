"""The embedded default: tiny checkpoints of every family, written locally, and their synthetic data.

:mod:`~qwenkit.model.tiny.checkpoint` writes a family's tiny HF checkpoint (offline tokenizer and
processor); each family's architecture at toy sizes is in :mod:`qwenkit.model.families.tiny_configs`;
:mod:`~qwenkit.model.tiny.data` the learnable synthetic datasets; :mod:`~qwenkit.model.tiny.vllm` the same
checkpoints at the shapes vLLM's CPU kernels run.
"""
