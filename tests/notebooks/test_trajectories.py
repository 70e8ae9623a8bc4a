"""Notebook 02's trajectory view (issue 61): a real agentic rollout (its first reply a scripted zoom call, the answer
sampled) written through the trainer's completions-file path, then drawn: the image inline is the tool's own crop,
pixel for pixel; the replies, the call and its arguments are there; a non-agentic file shows the 'none' line."""

from __future__ import annotations

import base64
import io
import json
import re

import torch
from conftest import build_model
from engine.rollouts.test_agentic import CALLS, _objective
from PIL import Image

from qwenkit.engine.objectives import completions
from qwenkit.model.tiny.agentic import ShapesZoom
from qwenkit.notebooks import trajectories

QUADRANT = "bottom left"  # where row 0's shape is: its crop is not one colour


def _written(tmp_path, then="They are red."):
    """The run folder whose completions file holds one logged step of a 2-completion agentic rollout of row 0,
    its sample through a checkpoint's save and load first (as a resume in the middle of a cycle keeps it)."""
    objective, _ = _objective(script=CALLS["hermes"].replace("top left", QUADRANT), then=then)
    done = objective.rollouts(build_model(chunk=True, seed=0), objective.bundle.dataset, [0], 0)
    per = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    lines = completions.sample(done, per, per.sum(1), torch.tensor([-1.0, 1.0]), [0, 0], ["exact", "zoomed"], 2, 0)
    torch.save(lines, tmp_path / "state.pt")
    lines = torch.load(tmp_path / "state.pt", weights_only=True)
    completions.append(tmp_path / "metrics" / completions.SAMPLE_FILE, 1, lines)
    return done, objective.bundle.dataset.columns(0)


def test_a_trajectory_shows_its_replies_call_and_the_tools_own_image_inline(tmp_path):
    done, row = _written(tmp_path)
    files = list((tmp_path / "metrics" / completions.TOOL_IMAGES).iterdir())
    assert len(files) == 1  # both completions zoomed into the same quadrant: one file
    line = json.loads((tmp_path / "metrics" / completions.SAMPLE_FILE).read_text().splitlines()[0])
    tool = line["messages"][1]
    assert tool["role"] == "tool" and tool["content"] == [{"type": "image", "size": [56, 56],
                                                           "file": f"tool_images/{files[0].name}"}]  # fmt: skip
    step, chosen = trajectories.chosen(tmp_path)
    assert step == 1 and [c["reward"] for c in chosen] == [2.0, 1.0]  # both called a tool: highest reward first
    page = trajectories.trajectory_html(chosen[0], tmp_path / "metrics")
    env = ShapesZoom()
    env.reset(**row)
    want = env.zoom(QUADRANT)
    assert len(set(want.getdata())) > 1
    (uri,) = re.findall(r'class="tool-image" src="data:image/png;base64,([^"]+)"', page)
    shown = Image.open(io.BytesIO(base64.b64decode(uri)))
    assert shown.size == want.size and list(shown.convert("RGB").getdata()) == list(want.getdata())
    assert f"calls <b>zoom</b>(<code>{{&quot;quadrant&quot;: &quot;{QUADRANT}&quot;}}</code>)" in page
    assert done[1].text in page and "2 turns, 1 calls (0 failed)" in page
    html = trajectories.view(tmp_path).data
    assert html.count('class="trajectory"') == 2 and "of step 1" in html


def test_a_run_without_trajectories_says_so_and_a_lost_image_is_its_caption(tmp_path):
    path = tmp_path / "metrics" / completions.SAMPLE_FILE
    completions.append(path, 1, [{"index": 0, "completion": "red", "reference": "red", "rewards": {"exact": 1.0},
                                  "reward": 1.0, "advantage": 0.0, "truncated": False}])  # fmt: skip
    assert trajectories.chosen(tmp_path) == (None, []) and trajectories.NONE in trajectories.view(tmp_path).data
    _written(tmp_path)
    for f in (tmp_path / "metrics" / completions.TOOL_IMAGES).iterdir():
        f.unlink()
    page = trajectories.trajectory_html(trajectories.chosen(tmp_path)[1][0], tmp_path / "metrics")
    assert "tool-image" not in page and "[image 56x56: tool_images/" in page
