"""Agentic rollouts (issue 61): trajectories against the official templates (TRL ships Qwen's with their tool
branches), the trainer's log-probs of the sampled ids against the sampler's, no gradient through tool tokens,
tool images' positions against HF's ``get_rope_index`` on the same conversation, tools' errors, the config refusals.

The random tiny model never writes a call by itself, so :class:`Scripted` makes its first reply a fixed call
(those ids carry no sampler log-prob: NaN) and samples every later reply for real.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from conftest import build_model, tiny_checkpoint, tiny_processor

from qwenkit import config as qconfig
from qwenkit import data
from qwenkit.data import tool_calls
from qwenkit.distributed import fsdp
from qwenkit.engine.objectives import grpo
from qwenkit.engine.rollouts import tools
from qwenkit.engine.rollouts.completion import training_batch
from qwenkit.engine.rollouts.hf import HfRollouts
from qwenkit.model.losses.cross_entropy import IGNORE_INDEX
from qwenkit.model.tiny.agentic import ShapesZoom, tiny_image

ENV = "qwenkit.model.tiny.agentic:ShapesZoom"
TOOL = "qwenkit.model.tiny.agentic:shape_colour"
CALLS = {"hermes": '<tool_call>\n{"name": "zoom", "arguments": {"quadrant": "top left"}}\n</tool_call>',
         "xml": "<think>\n\n</think>\n\n<tool_call>\n<function=zoom>\n<parameter=quadrant>\ntop left\n</parameter>\n"
                "</function>\n</tool_call>"}  # fmt: skip


def official_template(name: str) -> str:
    trl = pytest.importorskip("trl")
    return (Path(trl.__file__).parent / "chat_templates" / name).read_text()


class Scripted(HfRollouts):
    """HF rollouts whose first reply of every trajectory is ``script``'s ids (no sampler log-prob), then sampled."""

    def __init__(self, script, *args, then=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.script, self.then, self.calls = script, then, 0

    def sample_rows(self, model, prompts, seeds, end, pad, suppress, max_new_tokens=None):
        out = super().sample_rows(model, prompts, seeds, end, pad, suppress, max_new_tokens)
        self.calls += 1
        forced = self.script if self.calls == 1 else self.then if self.then is not None and self.calls == 2 else None
        if forced is not None:
            out = [list(forced) for _ in out]
            self.sampled_logps = [[math.nan] * len(forced) for _ in out]
        return out


def _objective(family="qwen2_5_vl", extra=(), script=None, then=None, temperature=1.0):
    path, processor = tiny_checkpoint(family), tiny_processor(family)
    cfg = qconfig.load(overrides=["train.objective=grpo", f"model.name={family}", f"model.path={path}",
                                  "data.tiny_samples=4", "train.micro_batch_size=1", "grpo.num_generations=2",
                                  "grpo.max_new_tokens=160", f"grpo.temperature={temperature}", f"grpo.environment={ENV}",
                                  f"grpo.tools=[{TOOL}]", *extra])  # fmt: skip
    objective = grpo.GrpoObjective(cfg, fsdp.Runtime(0, 1, 0, torch.device("cpu"), "gloo", False),
                                   data.build(cfg, processor), "pixels", reference=None)  # fmt: skip
    tok = processor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    style = processor.family.tool_calls
    hf = objective.rollouts.hf
    objective.rollouts.hf = Scripted(tok.encode(script or CALLS[style], add_special_tokens=False) + [end],
                                     hf.sampling, hf.num_generations, dtype=torch.float32,
                                     then=None if then is None else tok.encode(then, add_special_tokens=False) + [end])  # fmt: skip
    return objective, processor


def test_calls_parse_in_each_family_format():
    assert tool_calls.parse_calls("hermes", "no call") == []
    assert tool_calls.parse_calls("hermes", "a\n" + CALLS["hermes"]) == [{"name": "zoom", "arguments": {"quadrant": "top left"}}]
    assert tool_calls.parse_calls("xml", CALLS["xml"]) == [{"name": "zoom", "arguments": {"quadrant": "top left"}}]
    assert tool_calls.parse_calls("xml", "<tool_call>\n<function=f>\n<parameter=n>\n[1, 2]\n</parameter>\n</function>\n</tool_call>") == [
        {"name": "f", "arguments": {"n": [1, 2]}}]  # fmt: skip
    for bad in ("<tool_call>\n{\"name\": \"zoom\"", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>[1]</tool_call>"):
        assert tool_calls.parse_calls("hermes", bad) is None
    assert tool_calls.parse_calls("xml", "<tool_call>\nzoom\n</tool_call>") is None


@pytest.mark.parametrize("family, template", [("qwen2_5_vl", "qwen3_vl.jinja"), ("qwen3_vl", "qwen3_vl.jinja"),
                                              ("qwen3_5", "qwen3_5_nothink.jinja")])  # fmt: skip
def test_a_trajectory_is_the_official_template_rendering_with_the_tool_image_at_hfs_positions(family, template):
    """Prompt (tools in the system turn, reset's text), the call, the tool turn holding the zoomed image and the
    answer: token for token the official template's rendering of the same messages (Qwen2.5-VL's own template has
    no tool branch: Qwen3-VL's hermes one, with its system text); mm_token_type_ids, grids and pixels the
    processor's; mRoPE positions of the training row = HF's get_rope_index on that rendering."""
    from qwenkit.model.families import registry as families

    if why := families.get(family).unavailable():
        pytest.skip(why)
    answer = ("<think>\n\n</think>\n\n" if family == "qwen3_5" else "") + "They are red."
    objective, processor = _objective(family, then=answer)
    done = objective.rollouts(build_model(chunk=True, seed=0, name=family), objective.bundle.dataset, [0], 0)
    c = done[0]
    assert not c.truncated and c.trajectory["turns"] == 2 and c.trajectory["tool_calls"] == 1 and c.trajectory["tool_failures"] == 0
    row = objective.bundle.dataset.columns(0)
    env = ShapesZoom()
    said = env.reset(**row)
    question = objective.bundle.dataset.conversation(0).turns[0][1].replace("<image>", "")
    bound = tools.Toolbox([TOOL], ENV, 1.0).bind(row)
    zoomed = env.zoom("top left")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question + said}]},
                {"role": "assistant", "content": answer.split("They")[0] if family == "qwen3_5" else "",
                 "tool_calls": [{"type": "function", "function": {"name": "zoom", "arguments": {"quadrant": "top left"}}}]},
                {"role": "tool", "content": [{"type": "image"}]},
                {"role": "assistant", "content": answer}]  # fmt: skip
    if family == "qwen2_5_vl":
        messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
    text = processor.tokenizer.apply_chat_template(messages, tools=bound[1], chat_template=official_template(template),
                                                   tokenize=False)  # fmt: skip
    from PIL import Image

    shown = [Image.open(tiny_image(row["images"][0])).convert("RGB"), zoomed]
    pixels = processor.image_processor(images=shown, return_tensors="pt")
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == 3
    text = "".join(p + "<|image_pad|>" * processor.image_tokens(g) for p, g in zip(pieces, pixels["image_grid_thw"])) + pieces[-1]
    want = processor.tokenizer.encode(text, add_special_tokens=False)
    batch = training_batch(done[:1], processor.pad_token_id)
    got = batch["input_ids"][0].tolist()
    assert got + processor.tokenizer.encode("\n", add_special_tokens=False) == want
    torch.testing.assert_close(batch["image_grid_thw"], pixels["image_grid_thw"].long())
    torch.testing.assert_close(batch["pixel_values"], pixels["pixel_values"])
    ids = torch.tensor([want[:-1]])
    types = (ids == processor.image_token_id).long()
    if "mm_token_type_ids" in batch:
        torch.testing.assert_close(batch["mm_token_type_ids"], types)
    model = build_model(chunk=True, seed=0, name=family)
    kwargs = {"mm_token_type_ids": types} if "mm_token_type_ids" in batch else {}
    theirs, _ = model.model.get_rope_index(ids, image_grid_thw=pixels["image_grid_thw"], attention_mask=torch.ones_like(ids), **kwargs)
    ours_kw = {"mm_token_type_ids": batch["mm_token_type_ids"]} if "mm_token_type_ids" in batch else {}
    ours, _ = model.model.get_rope_index(batch["input_ids"], image_grid_thw=batch["image_grid_thw"],
                                         attention_mask=batch["attention_mask"], **ours_kw)  # fmt: skip
    torch.testing.assert_close(ours, theirs)
    tool = torch.tensor(c.mask) == 0
    start = batch["input_ids"].shape[1] - len(c.tokens)
    assert (batch["labels"][0, start:][tool] == IGNORE_INDEX).all() and (batch["labels"][0, start:][~tool] != IGNORE_INDEX).all()


def test_the_trainers_log_probs_of_the_sampled_ids_are_the_samplers_and_tool_tokens_carry_no_gradient():
    """T=1, fp32: every token sampled after the tool's image turn has the trainer's log-prob the sampler drew it
    with (so the training row reproduces the generation context: ids, image, positions); the loss's gradient
    with respect to the per-token log-probs is 0 on every tool token, and the normaliser counts model tokens only."""
    objective, processor = _objective()
    model = build_model(chunk=True, seed=0)
    done, rollouts = [], objective.rollouts
    objective.rollouts = lambda *args: done.extend(rollouts(*args)) or done
    (batch,) = objective._rollout(model, 1)
    assert all(c.trajectory["tool_calls"] == 1 and 0 in c.mask for c in done)
    counts = torch.stack([batch.pop("num_items"), batch.pop("num_samples")])
    inputs = {k: v for k, v in batch.items() if k not in grpo.OWN_KEYS}
    logps, _ = objective.logps(model, inputs)
    mask = batch["labels"][:, 1:] != IGNORE_INDEX  # [B, S - 1] the sampled tokens, in order
    assert counts[0] == mask.sum() == sum(sum(c.mask) for c in done)
    recorded = torch.cat([torch.tensor(c.sampling_logps) for c in done])  # the sampler's, NaN on the scripted call
    real = ~recorded.isnan()
    assert real.sum() > 0
    torch.testing.assert_close(logps[:, :-1][mask][real], recorded[real], rtol=1e-5, atol=1e-5)

    captured, own = {}, model.token_logps

    def keep(**kw):
        out = own(**kw)
        out[0].retain_grad()
        captured["logps"] = out[0]
        return out

    model.token_logps = keep
    batch["advantages"] = torch.tensor([1.0, -0.5])
    objective.begin([batch], counts)
    objective.loss(model, batch).backward()
    grad = captured["logps"].grad[:, :-1]  # [B, S - 1]
    tool = torch.zeros_like(mask)
    for b, c in enumerate(done):
        start = batch["attention_mask"][b].sum().item() - len(c.tokens)  # the prompt's length
        for k, m in enumerate(c.mask):
            tool[b, start + k - 1] = m == 0
    assert tool.any() and (grad[tool] == 0).all() and (grad[mask] != 0).any()


SEEN: list = []  # what own_zooms was given, one entry per completion scored


def own_zooms(prediction: str, reference: str, environments: list = (), **row) -> float:
    """A reward keeping the ``environments`` it gets (the test below reads them): its environment's zooms."""
    SEEN.append(environments)
    return float(len(environments[0].zooms))


def test_each_completions_reward_gets_its_own_environment_as_trls_environments_list():
    """TRL's keyword and type: ``environments``, a list of one environment per completion scored, here the one
    completion's own instance, the one its tools were bound to, read after its rollout (the scripted zoom in it)."""
    SEEN.clear()
    objective, _ = _objective(extra=["grpo.rewards=[engine.rollouts.test_agentic:own_zooms, qwenkit.model.tiny.agentic:zoomed]"])
    drawn = objective._draw(build_model(chunk=True, seed=0), 1)
    assert len(SEEN) == len(drawn.done) == 2 and all(len(envs) == 1 for envs in SEEN)
    assert SEEN[0][0] is not SEEN[1][0] and all(isinstance(envs[0], ShapesZoom) for envs in SEEN)
    assert all(envs[0].zooms[0] == "top left" for envs in SEEN)
    torch.testing.assert_close(drawn.per[:, 0], torch.tensor([float(len(envs[0].zooms)) for envs in SEEN]))
    torch.testing.assert_close(drawn.per[:, 1], torch.ones(2))  # the recipe's reward reads it the same way


def test_a_tool_error_or_timeout_is_a_message_counted_as_failed():
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long.
        """
        time.sleep(seconds)
        return "done"

    def broken(x: int) -> str:
        """Raise.

        Args:
            x: anything.
        """
        raise RuntimeError("boom")

    found = {"slow": slow, "broken": broken}
    assert tools.call(found, "slow", {"seconds": 0.0}, 1.0) == (["done"], False)
    parts, failed = tools.call(found, "slow", {"seconds": 2.0}, 0.2)
    assert failed and "timed out" in json.loads(parts[0])["error"]
    parts, failed = tools.call(found, "broken", {"x": 1}, 1.0)
    assert failed and json.loads(parts[0]) == {"error": "RuntimeError: boom"}
    parts, failed = tools.call(found, "nothing", {}, 1.0)
    assert failed and "not found" in parts[0]
    parts, failed = tools.call(found, "slow", {"wrong": 1}, 1.0)
    assert failed and "TypeError" in parts[0]


def test_an_unparsable_call_is_the_models_text_counted_as_a_failed_call():
    objective, _ = _objective(script="<tool_call>\n{not json}\n</tool_call>")
    done = objective.rollouts(build_model(chunk=True, seed=0), objective.bundle.dataset, [0], 0)
    assert all(c.trajectory["turns"] == 1 and c.trajectory["tool_failures"] == 1 and c.mask == [1] * len(c.tokens)
               for c in done)  # fmt: skip


class NoReset:
    def look(self, x: int) -> str:
        """Look.

        Args:
            x: where.
        """
        return str(x)


class Clash:
    def reset(self, **row):
        return None

    def shape_colour(self, name: str) -> str:
        """Clash.

        Args:
            name: a name.
        """
        return name


def untyped(x):
    """No types."""
    return x


def test_tools_that_cannot_run_are_refused_before_spawn(tmp_path, monkeypatch, capsys):
    here = "engine.rollouts.test_agentic"
    assert tools.problems([TOOL], ENV) == []
    assert "does not import" in tools.problems(["no_such_module:f"], None)[0]
    assert "has no JSON schema" in tools.problems([f"{here}:untyped"], None)[0]
    assert "has no reset" in tools.problems([], f"{here}:NoReset")[0]
    assert "two tools named 'shape_colour'" in tools.problems([TOOL], f"{here}:Clash")[0]
    from qwenkit import cli, launch

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("torchrun must not start"))
    out = tmp_path / "run"
    assert cli.main(["train", "train.objective=grpo", f"grpo.tools=[{here}:untyped]", f"train.output_dir={out}"]) == 2
    assert "grpo.tools: 'engine.rollouts.test_agentic:untyped' has no JSON schema" in capsys.readouterr().err
    assert cli.main(["train", "train.objective=grpo", f"grpo.environment={ENV}", "grpo.rollout_engine=vllm",
                     f"train.output_dir={out}"]) == 2  # fmt: skip
    assert "grpo.rollout_engine=vllm need grpo.max_trajectory_tokens > 0" in capsys.readouterr().err
    assert cli.main(["train", "train.objective=grpo", "grpo.max_tool_calling_iterations=2", f"train.output_dir={out}"]) == 2
    assert "set but neither grpo.tools nor grpo.environment" in capsys.readouterr().err


@pytest.mark.slow
def test_the_tiny_agentic_recipe_starts_from_its_tool_sft_on_two_ranks_and_logs_the_tools_metrics(tmp_path):
    """params/tiny_agentic_cpu.yaml through `qwenkit train` (2 gloo ranks, 2 steps) from its start recipe (here cut to
    2 steps of 8 rows: trained first, as a fresh clone's run trains its own): the tools/* metrics are logged, the
    completions file holds whole trajectories within grpo.max_new_tokens, and the rows are the tool questions."""
    import subprocess
    import sys

    from multiproc import free_port

    root = Path(__file__).parents[3]
    recipe = qconfig.load(root / "params" / "tiny_agentic_cpu.yaml")
    start = (root / recipe.model.init_recipe).read_text().replace("steps: 200", "steps: 2").replace("tiny_samples: 256", "tiny_samples: 8")
    (tmp_path / "start.yaml").write_text(start)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "qwenkit.cli", "train", "--config", "params/tiny_agentic_cpu.yaml",
                           "--master-port", str(free_port()), "train.steps=2", "data.tiny_samples=16",
                           f"model.init_from={tmp_path / 'start'}", f"model.init_recipe={tmp_path / 'start.yaml'}",
                           f"train.output_dir={out}"], cwd=root, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "start" / "checkpoints" / "step-00000002").is_dir()
    rows = [json.loads(line) for line in (out / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
    names = {r["metric"] for r in rows}
    assert {"tools/call_frequency", "tools/failure_frequency", "tools/turns_mean", "tools/model_tokens_mean",
            "tools/tool_tokens_mean", "rewards/zoomed/mean"} <= names  # fmt: skip
    lines = [json.loads(line) for line in (out / "metrics" / "completions.jsonl").read_text().splitlines()]
    assert lines and all(line["messages"][0]["role"] == "assistant" and line["turns"] >= 1 for line in lines)
    assert all(line["model_tokens"] <= recipe.grpo.max_new_tokens for line in lines)
    assert {line["reference"].split(" is ")[0] for line in lines} == {"It"}  # the tool questions' answers


def test_a_trajectory_does_not_depend_on_the_rows_rolled_out_beside_it():
    """What 2 ranks = 1 rests on: rows 0 and 1 rolled out together (one rank) give the trajectories they give
    rolled out apart (each on its own rank), token for token, after the tool's image turn too."""
    objective, _ = _objective()
    model = build_model(chunk=True, seed=0)
    together = objective.rollouts(model, objective.bundle.dataset, [0, 1], 3)
    apart = []
    for i in (0, 1):
        objective.rollouts.hf.calls = 0  # the script again: each rank's first reply
        apart += objective.rollouts(model, objective.bundle.dataset, [i], 3)
    assert [c.tokens for c in together] == [c.tokens for c in apart]
    assert [c.mask for c in together] == [c.mask for c in apart] and all(0 in c.mask for c in together)
