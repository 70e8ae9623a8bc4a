"""The embedded default: tiny checkpoints of every family, written locally, and their synthetic data.

:mod:`~qwenkit.model.tiny.checkpoint` writes a family's tiny HF checkpoint (offline tokenizer and
processor); :mod:`~qwenkit.model.tiny.configs` the toy sizes every family's tiny config shares (each family's module
builds its own on them);
:mod:`~qwenkit.model.tiny.data` the learnable synthetic datasets; :mod:`~qwenkit.model.tiny.vllm` the same
checkpoints at the shapes vLLM's CPU kernels run.
"""
