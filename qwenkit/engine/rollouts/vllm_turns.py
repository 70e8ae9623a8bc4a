"""An agentic rollout's turns on this rank's vLLM engine (``grpo.rollout_engine: vllm`` with ``grpo.tools`` /
``grpo.environment``): the turn sampler :class:`~qwenkit.engine.rollouts.agentic.AgenticRollouts` drives, as it drives
:class:`~qwenkit.engine.rollouts.hf.HfRollouts` (``begin``, ``turn_prompt``, ``sample_rows``, ``sampled_logps``).

**Token in, token out.** Each turn of a live trajectory is one request: ``prompt_token_ids`` are the kit's ids of
its prompt and of every token so far (the sampled ids and the rendered tool turns, never re-tokenized), each image's
pads collapsed to the one placeholder vLLM expands (:func:`~qwenkit.engine.generation.vllm_requests.prompt_ids`),
``multi_modal_data`` the row's images then each image a tool returned, as the tool returned it; vLLM's processor
resizes them into the run's pixel bounds as the kit's does, and after each turn
:func:`~qwenkit.engine.generation.vllm_requests.check_prompts` compares vLLM's expanded prompt with the kit's ids,
so a tool image vLLM tokenized otherwise stops the run instead of sampling from another prompt. Every live
trajectory of the rank is one batched ``generate`` per turn; each request is seeded as the hf engine's turn is
(:mod:`~qwenkit.engine.rollouts.agentic`) and carries vLLM's log-prob of each token it drew, for the
importance-sampling correction. The policy's weights are pushed once per rollout (:meth:`begin`, collective).

Cannot: rows with videos (their time texts are written around the video's pads; refused, naming the row).
"""

from __future__ import annotations

import torch
from torch import nn

from qwenkit.data.images import load
from qwenkit.engine.generation import vllm_engine
from qwenkit.engine.generation.sampling import Sampling
from qwenkit.engine.generation.vllm_requests import check_prompts, prompt_ids
from qwenkit.engine.rollouts.vllm import BANNED


class VllmTurns:
    """Turns of agentic trajectories from this rank's vLLM engine (module docstring); ``sampled_logps`` holds vLLM's
    log-probs of the last call's tokens."""

    def __init__(self, spec: vllm_engine.EngineSpec, sampling: Sampling, num_generations: int):
        if sampling.temperature <= 0:
            raise ValueError("rollouts sample: temperature must be > 0")
        self.spec, self.sampling, self.num_generations = spec, sampling, num_generations
        self.sampled_logps: list[list[float]] | None = None
        self.chosen = ("vllm", "grpo.rollout_engine=vllm: one request per live trajectory and turn")
        self.engine = None

    def begin(self, model: nn.Module) -> None:
        """The rollout starts: the policy's weights into the engine (every rank: the gather is collective)."""
        self.engine = vllm_engine.shared(self.spec)
        self.engine.push(model)

    @staticmethod
    def turn_prompt(trajectory, dataset) -> tuple[dict, list[int], object]:
        """``(vLLM request, the kit's ids, the row's place)`` of a trajectory's next turn (module docstring)."""
        conv = dataset.conversation(trajectory.index)
        if dataset.index.videos(trajectory.index):
            raise ValueError(f"{conv.where}: agentic rollouts on the vllm engine take image rows only (a video's time "
                             "texts are written around its pads); use grpo.rollout_engine=hf")  # fmt: skip
        processor = dataset.processor
        ids = trajectory.prompt["input_ids"][0].tolist() + trajectory.tokens
        images = [load(ref, conv.where) for ref in dataset.image_refs(trajectory.index, conv)] + trajectory.images
        request = {"prompt_token_ids": prompt_ids(ids, processor, [], conv.where)}
        if images:
            request["multi_modal_data"] = {"image": images}
        return request, ids, conv

    def sample_rows(self, model: nn.Module, prompts: list[tuple[dict, list[int], object]], seeds: list[int], end: int,
                    pad: int, suppress: list[int], max_new_tokens: int | None = None) -> list[list[int]]:  # fmt: skip
        """The new tokens of each of :meth:`turn_prompt`'s ``prompts``, one request each seeded by ``seeds``, ended by
        ``end`` or ``max_new_tokens``; ``suppress``: never drawn. ``sampled_logps``: vLLM's of each token drawn."""
        self.sampled_logps = []
        if not prompts:
            return []
        s = self.sampling
        params = [self.engine.params(n=1, temperature=s.temperature, top_p=s.top_p, seed=seed, logprobs=0,
                                     max_tokens=max_new_tokens or s.max_new_tokens, stop_token_ids=[end],
                                     logit_bias={t: BANNED for t in suppress})
                  for seed in seeds]  # fmt: skip
        outs = self.engine.generate([p[0] for p in prompts], params)
        check_prompts(outs, [(request, {"input_ids": torch.tensor([ids])}, conv) for request, ids, conv in prompts])
        tokens = []
        for out in outs:
            sample = out.outputs[0]
            drawn = list(sample.token_ids)
            tokens.append(drawn)
            self.sampled_logps.append([step[t].logprob for step, t in zip(sample.logprobs, drawn)])
        return tokens


__all__ = ["VllmTurns"]
