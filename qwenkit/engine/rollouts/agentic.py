"""Agentic rollouts (``grpo.tools`` / ``grpo.environment``): generate, call the tools, append their responses, generate again.

Behind the :class:`~qwenkit.engine.rollouts.completion.Rollouts` interface, on HF ``generate``
(:class:`~qwenkit.engine.rollouts.hf.HfRollouts`, its placement, batching, seeds and ``grpo.rollout_dtype``) or on
this rank's vLLM engine (:class:`~qwenkit.engine.rollouts.vllm_turns.VllmTurns`): the turn sampler, which starts the
rollout (``begin``), writes a trajectory's next turn as its prompt (``turn_prompt``), samples a batch of them
(``sample_rows``) and keeps their sampling log-probs (``sampled_logps``). Each completion is a **trajectory**:

1. its prompt: the row's prompt (:meth:`qwenkit.data.dataset.EncodedDataset.prompt`) with the tools' schemas in
   the system turn as the family's template writes them (:func:`~qwenkit.data.tool_calls.system_text`)
   and the text of its environment's ``reset(**row)`` appended to the last user turn (:mod:`~qwenkit.engine.rollouts.tools`);
2. each turn, every trajectory still alive on the rank is sampled in one batched ``generate`` (its prompt plus
   everything so far, images included), the reply cut at its end token or its budget: ``grpo.max_new_tokens``
   counts the model's tokens over the whole trajectory, ``grpo.max_trajectory_tokens`` (0: no limit) the model's
   and the tools' together;
3. the reply's calls are parsed in the family's format (:func:`~qwenkit.data.tool_calls.parse_calls`);
   none: the trajectory ends (its last reply is the answer the rewards read); a block that does not parse: it
   ends too, counted as a failed call; else each call runs (:func:`~qwenkit.engine.rollouts.tools.call`: an error
   or a timeout is a response saying so, counted as failed) and their responses are appended as the template
   renders ``role: tool`` messages, then the next reply's header. At most ``grpo.max_tool_calling_iterations``
   rounds of calls (TRL's name); a trajectory whose next responses would pass ``grpo.max_trajectory_tokens``
   ends there, truncated.

**Token in, token out.** A trajectory's tokens are the exact ids sampled and the exact ids of the rendered tool
turns, never re-tokenized text; its ``mask`` is 1 on the sampled ids and 0 on the tools' (so
:func:`~qwenkit.engine.rollouts.completion.training_batch` labels only the model's tokens, and no tool token is in
the ratio, the KL, the entropy or any length normaliser). An image a tool returns is processed by the family's
image processor and enters the next turn (and the training row) as real vision input: its pads are image
tokens (``mm_token_type_ids`` 1) and its pixels follow the prompt's, so the model's own ``get_rope_index`` gives
it the positions it gives the same conversation rendered whole.

**Reproducible.** Turn 0 of completion ``g`` of row ``i`` draws from :func:`completion_seed`'s seed (a trajectory
without a call is the plain rollout's completion), turn ``t`` from a seed hashed from it and ``t``; every rank
takes as many turns as the busiest (a rank with no trajectory alive joins with none: the gathered weights and
lockstep forwards are collective), so 2 ranks sample what 1 process does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from qwenkit.data import tool_calls
from qwenkit.engine.rollouts import tools
from qwenkit.engine.rollouts.completion import Completion, completion, completion_seed, media_tokens

STATS = ("tool_calls", "tool_failures", "turns", "model_tokens", "tool_tokens")  # a trajectory's counts


@dataclass
class Trajectory:
    """One completion being rolled out: its prompt, the tokens so far (mask 1 sampled, 0 a tool's) and the tools' images."""

    index: int
    prompt: dict[str, torch.Tensor]  # [1, S] per-token keys
    seed: int
    tools: dict
    environment: object | None
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)  # the sampler's log-prob of each sampled token (grpo.rollout_dtype)
    pixels: list[torch.Tensor] = field(default_factory=list)  # each tool image's pixel_values
    grids: list[torch.Tensor] = field(default_factory=list)  # each tool image's image_grid_thw [1, 3]
    images: list = field(default_factory=list)  # each tool image as the tool returned it (a vLLM turn's input)
    messages: list[dict] = field(default_factory=list)  # the trajectory as chat messages (the completions file)
    text: str = ""  # the last reply, decoded
    alive: bool = True
    truncated: bool = False
    stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATS, 0))

    def media(self, image_token: int) -> dict[str, torch.Tensor]:
        """The tokens' own model inputs: the tools' pixels and grids, the tokens' ``mm_token_type_ids``."""
        out = {}
        if self.pixels:
            out = {"pixel_values": torch.cat(self.pixels), "image_grid_thw": torch.cat(self.grids)}
        if "mm_token_type_ids" in self.prompt:
            types = (torch.tensor([self.tokens], dtype=torch.long) == image_token).long()  # [1, T]
            out["mm_token_type_ids"] = types.to(self.prompt["mm_token_type_ids"].dtype)
        return out

    def inputs(self, image_token: int) -> dict[str, torch.Tensor]:
        """The next turn's prompt: the prompt and every token so far, the prompt's media then the tools'."""
        p, own = self.prompt, self.media(image_token)
        new = torch.tensor([self.tokens], dtype=p["input_ids"].dtype)  # [1, T]
        ids = torch.cat([p["input_ids"], new], dim=1)
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        for key, value in p.items():
            if key not in out:
                out[key] = torch.cat([value, own.pop(key)], dim=-1 if key == "mm_token_type_ids" else 0) if key in own else value
        return out | own


class AgenticRollouts:
    """Trajectories through the turn sampler ``hf`` and the tools (module docstring). ``hf``: an
    :class:`~qwenkit.engine.rollouts.hf.HfRollouts` (its placement, batching, seeds and dtype) or a
    :class:`~qwenkit.engine.rollouts.vllm_turns.VllmTurns`; ``toolbox``: the resolved tools; ``max_turns``:
    ``grpo.max_tool_calling_iterations``; ``max_trajectory_tokens``: 0 for no limit."""

    def __init__(self, hf, toolbox: tools.Toolbox, max_turns: int, max_trajectory_tokens: int = 0):
        self.hf, self.toolbox, self.max_turns, self.max_trajectory_tokens = hf, toolbox, max_turns, max_trajectory_tokens
        self.chosen = None

    def __call__(self, model: nn.Module, dataset, indices: list[int], draw: int) -> list[Completion]:
        processor, n = dataset.processor, self.hf.num_generations
        tok, style = processor.tokenizer, processor.family.tool_calls
        end = tok.convert_tokens_to_ids("<|im_end|>")
        refs, trajectories, rows = [], [], []
        for i in indices:
            row = dataset.columns(i)
            shared = None
            for g in range(n):
                bound = self.toolbox.bind(row)
                if shared is None or bound[2] is not None:  # an environment's reset may change the prompt
                    shared = dataset.prompt(i, edit=_with_tools(dataset, style, bound[1], bound[3]))
                seed = completion_seed(self.hf.sampling.seed, draw, i, g)
                trajectories.append(Trajectory(i, shared[0], seed, bound[0], bound[2]))
                refs.append(shared[1].reference)
                rows.append(row | ({"environments": [bound[2]]} if bound[2] is not None else {}))  # TRL's keyword (rewards.py)
        self.hf.begin(model)
        for turn in range(self.max_turns + 1):
            alive = [t for t in trajectories if t.alive]
            if not _anyone(len(alive), next(model.parameters()).device):
                break
            self._turn(model, alive, turn, dataset, end, style)
        self.chosen = self.hf.chosen
        return [Completion(t.index, t.prompt, t.tokens, t.text, t.truncated, ref, row,
                           t.logps if self.hf.sampled_logps is not None else None, mask=t.mask,
                           media=t.media(processor.image_token_id),
                           trajectory={"messages": t.messages, **t.stats})
                for t, ref, row in zip(trajectories, refs, rows)]  # fmt: skip

    def _turn(self, model: nn.Module, alive: list[Trajectory], turn: int, dataset, end: int, style: str) -> None:
        """One reply of every trajectory in ``alive`` (one batched sampling), then their tools' responses."""
        processor = dataset.processor
        tok = processor.tokenizer
        for t in alive:
            if self._room(t) == 0:  # the model's budget spent by its last reply: the responses end it
                t.alive, t.truncated = False, True
        alive = [t for t in alive if t.alive]
        rooms = [self._room(t) for t in alive]
        seeds = [t.seed if turn == 0 else completion_seed(t.seed, turn, t.index, 0) for t in alive]
        new = self.hf.sample_rows(model, [self.hf.turn_prompt(t, dataset) for t in alive], seeds, end, processor.pad_token_id,
                                  media_tokens(processor), max_new_tokens=max(rooms, default=1))  # fmt: skip
        for r, (t, ids, room) in enumerate(zip(alive, new, rooms)):
            ids, t.text, cut = completion(tok, ids[:room], end)
            t.tokens += ids
            t.mask += [1] * len(ids)
            if self.hf.sampled_logps is not None:
                t.logps += self.hf.sampled_logps[r][: len(ids)]
            t.stats["model_tokens"] += len(ids)
            t.stats["turns"] += 1
            calls = None if cut else tool_calls.parse_calls(style, t.text)
            said = {"role": "assistant", "content": t.text}
            t.messages.append(said)
            if cut or not calls or turn == self.max_turns:
                t.alive, t.truncated = False, cut
                if calls is None and not cut:  # an unparsable call: the model's text, a failed call
                    t.stats["tool_calls"] += 1
                    t.stats["tool_failures"] += 1
                continue
            said["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            self._respond(t, calls, processor, style)

    def _room(self, t: Trajectory) -> int:
        """How many tokens ``t``'s next reply may take."""
        room = self.hf.sampling.max_new_tokens - t.stats["model_tokens"]
        if self.max_trajectory_tokens:
            room = min(room, self.max_trajectory_tokens - len(t.tokens))
        return max(room, 0)

    def _respond(self, t: Trajectory, calls: list[dict], processor, style: str) -> None:
        """Run ``calls`` and append their responses' turn (mask 0), as the template renders ``tool`` messages."""
        contents, pixels, grids, images, messages = [], [], [], [], []
        for c in calls:
            parts, failed = tools.call(t.tools, c["name"], c["arguments"], self.toolbox.timeout_s)
            t.stats["tool_calls"] += 1
            t.stats["tool_failures"] += int(failed)
            text, shown = "", []
            for part in parts:
                if isinstance(part, str):
                    text += part
                    shown.append({"type": "text", "text": part})
                    continue
                out = processor.image_processor(images=[part], return_tensors="pt")
                pixels.append(out["pixel_values"])
                images.append(part)
                grids.append(out["image_grid_thw"].long())
                text += "<|vision_start|>" + "<|image_pad|>" * processor.image_tokens(out["image_grid_thw"][0]) + "<|vision_end|>"
                shown.append({"type": "image", "size": list(part.size), "image": part})  # the file keeps it (completions.trajectory)
            contents.append(text)
            messages.append({"role": "tool", "name": c["name"], "content": shown})
        ids = processor.tokenizer.encode("\n" + tool_calls.response_text(style, contents) + "<|im_start|>assistant\n",
                                         add_special_tokens=False)  # fmt: skip
        if self.max_trajectory_tokens and len(t.tokens) + len(ids) >= self.max_trajectory_tokens:
            t.alive, t.truncated = False, True  # no room for the responses and a reply
            return
        t.tokens += ids
        t.mask += [0] * len(ids)
        t.pixels += pixels
        t.grids += grids
        t.images += images
        t.stats["tool_tokens"] += len(ids)
        t.messages += messages


def _with_tools(dataset, style: str, schemas: list[dict], said: str):
    """The edit of a row's conversation that puts the tools in its system turn and ``said`` after its last user turn."""
    def edit(conv):
        system = conv.system if conv.system is not None else dataset.template.system_prompt
        turns = list(conv.turns)
        last = max(k for k, (role, _) in enumerate(turns) if role == "user")
        turns[last] = ("user", turns[last][1] + said)
        return dataclasses.replace(conv, system=tool_calls.system_text(style, system, schemas), turns=turns)

    return edit


def _anyone(count: int, device: torch.device) -> bool:
    """Whether any rank has a trajectory alive (collective: every rank takes as many turns)."""
    alive = torch.tensor([count], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(alive, op=dist.ReduceOp.MAX)
    return bool(alive.item())


def metrics(everyone: dict[str, torch.Tensor]) -> dict[str, float]:
    """TRL's ``tools/call_frequency`` (calls per completion) and ``tools/failure_frequency`` (failed calls per call),
    and the means of turns, model tokens and tool tokens per trajectory, over every rank's completions."""
    calls, failures = everyone["tool_calls"].sum().item(), everyone["tool_failures"].sum().item()
    out = {"tools/call_frequency": calls / max(len(everyone["tool_calls"]), 1),
           "tools/failure_frequency": failures / calls if calls else 0.0}  # fmt: skip
    out |= {f"tools/{k}_mean": everyone[k].mean().item() for k in ("turns", "model_tokens", "tool_tokens")}
    return out


__all__ = ["STATS", "AgenticRollouts", "Trajectory", "metrics"]
