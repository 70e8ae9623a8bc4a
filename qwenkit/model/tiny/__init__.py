"""The embedded default: tiny checkpoints of every family, written locally, and their synthetic data.

:mod:`~qwenkit.model.tiny.checkpoint` writes a family's tiny HF checkpoint (offline tokenizer and
processor); each family's architecture at toy sizes is in :mod:`qwenkit.model.families.tiny_configs`;
:mod:`~qwenkit.model.tiny.data` the learnable synthetic datasets; :mod:`~qwenkit.model.tiny.vllm` the vLLM
tests' copies of the tiny Qwen3.5s and Qwen3-VL-MoE, changed as vLLM's CPU backend takes them (the others run as they are).
"""
