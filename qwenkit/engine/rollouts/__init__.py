"""Rollouts: completions sampled from the current policy, for every objective that samples (GRPO).

:mod:`~qwenkit.engine.rollouts.completion` is the interface: :class:`~qwenkit.engine.rollouts.completion.Rollouts` (``rollouts(model,
dataset, indices, draw) -> [Completion]``) and what every engine hands back and the loss reads
(:class:`~qwenkit.engine.rollouts.completion.Completion`, the training batch of completions); :mod:`~qwenkit.engine.rollouts.hf` samples
with HF ``generate`` from the policy's own weights, :mod:`~qwenkit.engine.rollouts.vllm` with a vLLM
engine the weights are pushed to; :mod:`~qwenkit.engine.rollouts.agentic` rolls out multi-turn trajectories with tools
on either (its vLLM turns: :mod:`~qwenkit.engine.rollouts.vllm_turns`).
"""
