"""GRPO's rollouts from a colocated vLLM engine (``grpo.rollout_engine: vllm``), behind the :class:`~qwenkit.engine.rollouts.completion.Rollouts` interface.

Before each rollout the policy's weights are pushed into this rank's engine
(:meth:`qwenkit.engine.generation.vllm_engine.VllmEngine.push`: every rollout follows the optimizer steps
since the last one, and a resumed run's first rollout follows its checkpoint), then each completion
is one request seeded by :func:`~qwenkit.engine.rollouts.completion.completion_seed` (as
:class:`~qwenkit.engine.rollouts.hf.HfRollouts`: a completion depends on the run, the draw, the row
and its number in the group only, not on the rank or the other rows; the group's shared prompt is
vLLM's prefix cache's), media tokens never drawn. Each completion
carries vLLM's log-prob of each of its tokens (``Completion.sampling_logps``: after temperature, as
the trainer's ``token_logps`` under ``grpo.temperature``), for the importance-sampling
correction (:func:`qwenkit.model.losses.policy.vllm_importance_weights`). The completions are cut and decoded
as HF's are (:func:`~qwenkit.engine.rollouts.completion.completion`), and train on the kit's own prompt inputs.
"""

from __future__ import annotations

from torch import nn

from qwenkit.engine.generation import vllm_engine
from qwenkit.engine.generation.sampling import Sampling
from qwenkit.engine.generation.vllm_requests import check_prompts, request
from qwenkit.engine.rollouts.completion import Completion, completion, completion_seed, media_tokens

BANNED = -100.0  # vLLM's logit_bias bound: a media token is never drawn


class VllmRollouts:
    """Rollouts from this rank's vLLM engine (module docstring); the engine starts at the first rollout."""

    def __init__(self, spec: vllm_engine.EngineSpec, sampling: Sampling, num_generations: int):
        if sampling.temperature <= 0:
            raise ValueError("rollouts sample: temperature must be > 0")
        self.spec, self.sampling, self.num_generations = spec, sampling, num_generations

    def __call__(self, model: nn.Module, dataset, indices: list[int], draw: int) -> list[Completion]:
        engine = vllm_engine.shared(self.spec)
        engine.push(model)
        tok = dataset.processor.tokenizer
        end = tok.convert_tokens_to_ids("<|im_end|>")
        s = self.sampling
        asked = [request(dataset, i) for i in indices]
        keys = [(k, g) for k in range(len(indices)) for g in range(self.num_generations)]  # [position in indices, g]
        params = [engine.params(n=1, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_new_tokens,
                                seed=completion_seed(s.seed, draw, indices[k], g), logprobs=0, stop_token_ids=[end],
                                logit_bias={t: BANNED for t in media_tokens(dataset.processor)})
                  for k, g in keys]  # fmt: skip
        outs = engine.generate([asked[k][0] for k, _ in keys], params)
        check_prompts(outs, [asked[k] for k, _ in keys])
        done = []
        for (k, _), out in zip(keys, outs):
            i, (_, prompt, conv) = indices[k], asked[k]
            columns = dataset.columns(i)
            for sample in out.outputs:
                drawn = list(sample.token_ids)
                logps = [step[t].logprob for step, t in zip(sample.logprobs, drawn)]
                new, text, truncated = completion(tok, drawn, end)
                done.append(Completion(i, prompt, new, text, truncated, conv.reference, columns, logps[: len(new)]))
        return done


__all__ = ["VllmRollouts"]
