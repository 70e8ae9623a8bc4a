"""The embedded default's synthetic datasets (``data.path: tiny``): coloured shapes asked about in every
layout (:func:`write_dataset`), their preference pairs (:func:`write_preference_dataset`), for the Omni
thinkers, short tones asked about their pitch (:func:`write_tone_dataset`, ``data.tiny_task: tones``) and, for
tool SFT, the shapes asked about through the agentic task's tools (:func:`write_tool_dataset`, ``data.tiny_task:
tools``) and their questions alone, the agentic recipe's prompts (:func:`write_tool_question_dataset`,
``data.tiny_task: tool_questions``); each
written once per size and seed into the tiny cache folder (:func:`ensure_dataset`), nothing downloaded."""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import wave
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

TINY_IMAGE_SIDE = 112  # 112 px = 8x8 patches of 14 = 16 image tokens after the 2x2 merge


def cache_root() -> Path:
    return Path(os.environ.get("QWENKIT_CACHE", Path.home() / ".cache" / "qwenkit"))


COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 210, 40),
    "purple": (150, 60, 190),
    "white": (245, 245, 245),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
NUMBER_WORDS = ("zero", "one", "two", "three", "four")
EVAL_SEED = 1  # the held-out synthetic set (data.tiny_eval_samples); training rows use seed 0


# ---------------------------------------------------------------------------------------------
# Synthetic dataset: coloured shapes, questions about colour, shape, count and position


def _draw(rng: random.Random, side: int = TINY_IMAGE_SIDE):
    colour = rng.choice(list(COLOURS))
    shape = rng.choice(SHAPES)
    count = rng.randint(1, 4)
    background = (20, 20, 20) if colour != "white" else (90, 90, 90)
    image = Image.new("RGB", (side, side), background)
    draw = ImageDraw.Draw(image)
    quadrants = sorted(rng.sample(range(4), count))  # reading order: "the first shape" is well defined
    half = side // 2
    for q in quadrants:
        x0, y0 = (q % 2) * half + 8, (q // 2) * half + 8
        box = (x0, y0, x0 + half - 16, y0 + half - 16)
        if shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=COLOURS[colour])
    return image, {"colour": colour, "shape": shape, "count": count, "position": POSITIONS[quadrants[0]]}


def _qa(rng: random.Random, facts: dict) -> tuple[str, str]:
    return _qa_of(rng.choice(("colour", "shape", "count", "position")), facts)


def _qa_of(kind: str, facts: dict) -> tuple[str, str]:
    plural = "s" if facts["count"] > 1 else ""
    if kind == "colour":
        return "What colour are the shapes?", f"They are {facts['colour']}."
    if kind == "shape":
        return "Which shape is shown?", f"A {facts['shape']}."
    if kind == "count":
        return "How many shapes are there?", f"There {'are' if plural else 'is'} {NUMBER_WORDS[facts['count']]}."
    return "Where is the first shape?", f"In the {facts['position']}."


def _images(out_dir: Path, n: int, seed: int):
    """``(i, rng, name, facts)`` for ``n`` drawn images saved as ``images/00000.png`` ...: the row's writer draws
    its questions from the same ``rng`` after each image, so a dataset is a function of ``seed``."""
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(n):
        image, facts = _draw(rng)
        name = f"images/{i:05d}.png"
        image.save(out_dir / name)
        yield i, rng, name, facts


def write_dataset(out_dir: str | Path, n: int = 64, seed: int = 0) -> Path:
    """Write ``n`` samples as ``tiny.json`` plus PNG images; returns the JSON path.

    A third of the samples are two-turn conversations (two questions about the same image), so
    multi-turn masking is exercised by the embedded default too.
    """
    rows = []
    for i, rng, name, facts in _images(Path(out_dir), n, seed):
        q1, a1 = _qa(rng, facts)
        messages = [{"role": "user", "content": f"<image>{q1}"}, {"role": "assistant", "content": a1}]
        if i % 3 == 2:
            q2, a2 = _qa(rng, facts)
            messages += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
        rows.append({"messages": messages, "images": [name]})
    path = Path(out_dir) / "tiny.json"
    path.write_text(json.dumps(rows, indent=1))
    return path


_WRONG = {"colour": list(COLOURS), "count": [1, 2, 3, 4], "position": list(POSITIONS)}
# What the preference pairs ask about: what the tiny model's 16 image tokens let it tell apart. Not
# the shape: after params/tiny_cpu.yaml the SFT start prefers the right shape in 0.57 of 145 train
# pairs (a coin toss), and 120 DPO steps moved the shape pairs' reward margin by 0.05 (colour 5.4,
# count 2.3, position 3.0): pairs it cannot see only add noise to the held-out accuracy.
PREFERENCE_KINDS = tuple(_WRONG)


def write_preference_dataset(out_dir: str | Path, n: int = 64, seed: int = 0) -> Path:
    """Write ``n`` preference pairs as ``tiny.json`` plus PNG images; returns the JSON path.

    One question about the image; the chosen reply states the right fact, the rejected one the
    same sentence with a wrong colour, count or position (:data:`PREFERENCE_KINDS`). The rows rotate through the
    three accepted preference layouts (ms-swift, TRL conversational with typed parts,
    LLaMA-Factory sharegpt), so the embedded default reads each of them.
    """
    rows = []
    for i, rng, name, facts in _images(Path(out_dir), n, seed):
        kind = rng.choice(PREFERENCE_KINDS)
        wrong = dict(facts, **{kind: rng.choice([v for v in _WRONG[kind] if v != facts[kind]])})
        question, chosen = _qa_of(kind, facts)
        rejected = _qa_of(kind, wrong)[1]
        if i % 3 == 0:  # ms-swift
            rows.append({"messages": [{"role": "user", "content": f"<image>{question}"},
                                      {"role": "assistant", "content": chosen}],
                         "rejected_response": rejected, "images": [name]})  # fmt: skip
        elif i % 3 == 1:  # TRL, conversational, typed parts
            rows.append({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}], "images": [name]})  # fmt: skip
        else:  # LLaMA-Factory sharegpt preference
            rows.append({"conversations": [{"from": "human", "value": f"<image>{question}"}],
                         "chosen": {"from": "gpt", "value": chosen}, "rejected": {"from": "gpt", "value": rejected},
                         "images": [name]})  # fmt: skip
    path = Path(out_dir) / "tiny.json"
    path.write_text(json.dumps(rows, indent=1))
    return path


# ---------------------------------------------------------------------------------------------
# Synthetic audio task (data.tiny_task=tones): which of three well-separated pitches a short tone has

TONES = {"low": 300.0, "mid": 1000.0, "high": 3000.0}  # Hz; each tone within 5 % of its class's pitch
TONE_RATE = 16_000  # Hz: what the Omni feature extractor takes, so no resampling


def write_tone(path: Path, hz: float, seconds: float, amplitude: float) -> None:
    """A sine tone as mono 16-bit PCM WAV at :data:`TONE_RATE` (the standard library's writer)."""
    t = np.arange(int(seconds * TONE_RATE)) / TONE_RATE
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(TONE_RATE)
        out.writeframes((amplitude * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2").tobytes())


def write_tone_dataset(out_dir: str | Path, n: int = 64, seed: int = 0) -> Path:
    """Write ``n`` rows asking a tone's pitch (``Low.``, ``Mid.``, ``High.``) as ``tiny.json`` plus WAVs (0.5 to
    1 s, 16 kHz); returns the JSON path. The rows rotate through LLaMA-Factory's messages, sharegpt and alpaca
    layouts, each with an ``audios`` column and one ``<audio>`` tag, so the embedded default reads each."""
    out_dir = Path(out_dir)
    (out_dir / "tones").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        pitch = rng.choice(list(TONES))
        name = f"tones/{i:05d}.wav"
        write_tone(out_dir / name, TONES[pitch] * rng.uniform(0.95, 1.05), rng.uniform(0.5, 1.0), rng.uniform(0.3, 0.8))
        question, answer = "<audio>Is this tone low, mid or high?", f"{pitch.capitalize()}."
        if i % 3 == 0:
            rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                         "audios": [name]})  # fmt: skip
        elif i % 3 == 1:
            rows.append({"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
                         "audios": [name]})  # fmt: skip
        else:
            rows.append({"instruction": question, "output": answer, "audios": [name]})
    path = out_dir / "tiny.json"
    path.write_text(json.dumps(rows, indent=1))
    return path


# ---------------------------------------------------------------------------------------------
# Tool SFT (data.tiny_task=tools): the agentic task's calls written out, to warm-start its agents

ZOOM_SIDE = 56  # a crop is resized to the tiny image processor's smallest side: 4 image tokens after the merge
# transformers.utils.get_json_schema of the agentic task's tools (qwenkit.model.tiny.agentic; a test keeps them equal)
TOOL_SCHEMAS = (
    {"type": "function", "function": {"name": "shape_colour", "description": "The RGB value of a colour the shapes are drawn in.",
     "parameters": {"type": "object", "properties": {"name": {"type": "string", "description": "the colour's name (red, green, blue, ...)."}},
                    "required": ["name"]}, "return": {"type": "string"}}},
    {"type": "function", "function": {"name": "zoom", "description": "Zoom into one quadrant of the image.",
     "parameters": {"type": "object", "properties": {"quadrant": {"type": "string", "description": "top left, top right, bottom left or bottom right."}},
                    "required": ["quadrant"]}, "return": {"type": "image"}}},
)  # fmt: skip


def zoom_crop(image: Image.Image, quadrant: str) -> Image.Image:
    """One quadrant (:data:`POSITIONS`) of a synthetic image, resized to :data:`ZOOM_SIDE` (the zoom tool's answer)."""
    k, half = POSITIONS.index(quadrant), image.width // 2
    x, y = (k % 2) * half, (k // 2) * half
    return image.crop((x, y, x + half, y + half)).resize((ZOOM_SIDE, ZOOM_SIDE))


def write_tool_dataset(out_dir: str | Path, n: int = 64, seed: int = 0) -> Path:
    """Write ``n`` tool conversations as ``tiny.json`` plus PNG images (and the zoom crops); returns the JSON path.

    Each row offers both tools (:data:`TOOL_SCHEMAS`): even rows ask the shapes' RGB value, answered by calling
    ``shape_colour``; odd rows ask the first shape's colour, answered after ``zoom`` into its quadrant returned
    the crop as an image. The rows rotate through the tool layouts: HF messages (``tool_calls``, ``role: tool``),
    LLaMA-Factory sharegpt (``function_call`` / ``observation``, bare schemas as a JSON string), ms-swift
    (``tool_call`` / ``tool_response``) and HF typed parts (the zoom rows: the crop a ``tool`` message's image)."""
    rows = []
    for i, _, name, facts in _images(Path(out_dir), n, seed):
        colour, schemas = facts["colour"], list(TOOL_SCHEMAS)
        if i % 2:
            crop = f"images/{i:05d}-zoom.png"
            with Image.open(Path(out_dir) / name) as image:
                zoom_crop(image.convert("RGB"), facts["position"]).save(Path(out_dir) / crop)
            call = {"name": "zoom", "arguments": {"quadrant": facts["position"]}}
            rows.append({"messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Zoom into the first shape: what colour is it?"}]},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                {"role": "tool", "content": [{"type": "image"}]},
                {"role": "assistant", "content": f"It is {colour}."}], "images": [name, crop], "tools": schemas})  # fmt: skip
            continue
        question, rgb = "<image>What is the RGB value of the shapes' colour?", str(list(COLOURS[colour]))
        call, answer = {"name": "shape_colour", "arguments": {"name": colour}}, f"It is {rgb}."
        if i % 6 == 0:  # HF / TRL messages
            rows.append({"messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
                {"role": "tool", "content": rgb}, {"role": "assistant", "content": answer}],
                "images": [name], "tools": schemas})  # fmt: skip
        elif i % 6 == 2:  # LLaMA-Factory sharegpt
            rows.append({"conversations": [
                {"from": "human", "value": question}, {"from": "function_call", "value": json.dumps(call)},
                {"from": "observation", "value": rgb}, {"from": "gpt", "value": answer}],
                "images": [name], "tools": json.dumps([t["function"] for t in schemas])})  # fmt: skip
        else:  # ms-swift
            rows.append({"messages": [
                {"role": "user", "content": question}, {"role": "tool_call", "content": json.dumps(call)},
                {"role": "tool_response", "content": rgb}, {"role": "assistant", "content": answer}],
                "images": [name], "tools": json.dumps(schemas)})  # fmt: skip
    path = Path(out_dir) / "tiny.json"
    path.write_text(json.dumps(rows, indent=1))
    return path


def write_tool_question_dataset(out_dir: str | Path, n: int = 64, seed: int = 0) -> Path:
    """The rows of :func:`write_tool_dataset` (the same images, questions and answers) without their calls: the user's
    question and the final answer only, GRPO's prompts for the agentic recipe, whose model calls the tools itself.
    Each row names its image set (``tiny_task``) for the environment that opens the image
    (:func:`qwenkit.model.tiny.agentic.tiny_image`)."""
    path = write_tool_dataset(out_dir, n, seed)
    rows = []
    for row in json.loads(path.read_text()):
        turns = row.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
                                         "content": t["value"]} for t in row["conversations"]]  # fmt: skip
        question = turns[0]["content"]
        if not isinstance(question, str):  # typed parts: the image, then the text
            question = "<image>" + "".join(part.get("text", "") for part in question)
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": turns[-1]["content"]}],
                     "images": row["images"][:1], "tiny_task": "tool_questions"})  # fmt: skip
    path.write_text(json.dumps(rows, indent=1))
    return path


# data.tiny_task -> its writer
_WRITERS = {"shapes": write_dataset, "tones": write_tone_dataset, "tools": write_tool_dataset,
            "tool_questions": write_tool_question_dataset}  # fmt: skip


def ensure_dataset(
    n: int = 64, seed: int = 0, root: str | Path | None = None, preference: bool = False, task: str = "shapes"
) -> Path:
    """The synthetic dataset of ``task`` (``data.tiny_task``; ``preference``: the shapes' pairs) in the cache
    folder, written once per (task, n, seed)."""
    root = Path(root) if root is not None else cache_root()
    if preference and task != "shapes":
        raise ValueError(f"data.tiny_task={task!r} has no preference pairs; the tiny pairs are the shapes'")
    name = f"tiny-pairs-n{n}-s{seed}-v3" if preference else f"tiny-data-n{n}-s{seed}-v2"
    path = root / (name if task == "shapes" else f"tiny-{task}-n{n}-s{seed}-v1")
    if (path / "tiny.json").is_file():
        return path / "tiny.json"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".data-", dir=root))
    try:
        (write_preference_dataset if preference else _WRITERS[task])(tmp, n=n, seed=seed)
        try:
            tmp.rename(path)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path / "tiny.json"


def corpus() -> list[str]:
    """Every question and answer the synthetic dataset can contain, plus the template's words."""
    lines = ["You are a helpful assistant.", "system", "user", "assistant"]
    for colour in COLOURS:
        for shape in SHAPES:
            for count in range(1, 5):
                for position in POSITIONS:
                    facts = {"colour": colour, "shape": shape, "count": count, "position": position}
                    for kind in ("colour", "shape", "count", "position"):
                        lines.extend(_qa_of(kind, facts))
    return lines
