"""A tiny checkpoint that calls a tool: what the tests of agentic training on real trainers need (issue 61).

The random tiny model never writes a parsable ``<tool_call>``, so a ``qwenkit train`` of the agentic recipe rolls
out one-turn trajectories only. :func:`calling_checkpoint` fine-tunes the tiny checkpoint (in this process, a few
seconds) to answer every agentic prompt of :class:`Looking` (the tools in the system turn, reset's line after the
question) with :data:`CALL`, then saves it as an HF directory: sampled at temperature 1, nearly every first reply
is that call, so a trajectory takes a tool's image turn and replies again, as many turns as
``grpo.max_tool_calling_iterations`` allows or the model's later replies make.

:data:`PAUSE_ENV` lets a test hold a rollout in flight: the first ``look()`` called after a file ``armed``
appears in that folder renames it ``paused`` and waits (at most :data:`PAUSE_S`) for a file ``go`` there. The
tool's answer is the same: a paused run samples what an unpaused one does.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
from conftest import build_model, tiny_checkpoint, tiny_processor
from PIL import Image

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.engine.checkpoints.export import PROCESSOR_FILES
from qwenkit.engine.rollouts import agentic, tools
from qwenkit.engine.rollouts.completion import Completion, training_batch
from qwenkit.model.tiny.agentic import ShapesZoom
from qwenkit.model.tiny.data import cache_root

ENV = "tool_caller:Looking"  # tests/ on the path (pytest's rootdir; PYTHONPATH for a job)
CALL = '<tool_call>\n{"name": "look"}\n</tool_call>'
VERSION = 1  # of the fine-tune below: a new one writes a new folder
PAUSE_ENV = "QWENKIT_TEST_TOOL_PAUSE"  # a folder: a rollout in flight waits there once (module docstring)
PAUSE_S = 120.0  # a test that never says go does not hang the run for longer


class Looking(ShapesZoom):
    """:class:`~qwenkit.model.tiny.agentic.ShapesZoom` with one tool of no argument (a short call to learn)."""

    def look(self) -> Image.Image:
        """Look closer at the bottom left quadrant of the image."""
        _pause_once()
        return self.zoom("bottom left")


def _pause_once() -> None:
    folder = os.environ.get(PAUSE_ENV)
    if not folder:
        return
    try:
        os.rename(Path(folder) / "armed", Path(folder) / "paused")  # one call of one rank wins
    except FileNotFoundError:
        return
    deadline = time.monotonic() + PAUSE_S
    while not (Path(folder) / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def calling_checkpoint(steps: int = 100, rows: int = 4) -> Path:
    """The tiny checkpoint fine-tuned to answer the agentic prompts of the first ``rows`` tiny rows with
    :data:`CALL` (module docstring); written once into the cache, like the tiny checkpoint itself."""
    out = cache_root() / f"tiny-caller-v{VERSION}-s{steps}-r{rows}"
    if (out / "config.json").is_file():
        return out
    processor = tiny_processor()
    cfg = qconfig.load(overrides=["train.objective=grpo", f"grpo.environment={ENV}", f"data.tiny_samples={rows}"])
    dataset = data.build(cfg, processor).dataset
    box, style = tools.Toolbox([], ENV, 1.0), processor.family.tool_calls
    tok = processor.tokenizer
    reply = tok.encode(CALL, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    done = []
    for i in range(rows):
        _, schemas, _, said = box.bind(dataset.columns(i))
        prompt, _ = dataset.prompt(i, edit=agentic._with_tools(dataset, style, schemas, said))
        done.append(Completion(i, prompt, reply, CALL, False, ""))
    torch.manual_seed(0)
    model = build_model(chunk=True)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(steps):
        part = done[(step * 2) % rows :][:2]
        loss = model(**training_batch(part, processor.pad_token_id)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    base = Path(tiny_checkpoint())
    for name in ("config.json", *PROCESSOR_FILES):  # the base's config: HF's architecture name, not the kit's subclass
        if (base / name).is_file():
            shutil.copy2(base / name, tmp / name)
    try:
        os.replace(tmp, out)
    except OSError:  # another process wrote it first: the same fine-tune
        shutil.rmtree(tmp, ignore_errors=True)
    return out
