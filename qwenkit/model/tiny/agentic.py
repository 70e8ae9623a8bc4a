"""The tiny agentic task (``params/tiny_agentic_cpu.yaml``): a zoom tool over the synthetic shapes, an environment
per completion, and the reward that reads it (TRL's ``environment_factory`` shape; :mod:`qwenkit.engine.rollouts.tools`).

:class:`ShapesZoom` is ``grpo.environment``: ``reset(**row)`` finds the row's image (the synthetic training set
draws image ``k`` alike whatever its size, so any written copy of the seed-0 set holds it) and its public method
:meth:`ShapesZoom.zoom` is the model's tool, returning a crop of one quadrant as an image: the next turn sees it as
vision tokens. :func:`shape_colour` is a plain ``grpo.tools`` function (text in, text out).
:func:`zoomed` is a reward (``grpo.rewards``) reading the completion's environment: 1 when the trajectory zoomed
at least once without an error.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from qwenkit.model.tiny.data import COLOURS, POSITIONS, ZOOM_SIDE, cache_root, zoom_crop


def tiny_image(name: str, task: str = "shapes") -> Path:
    """Where image ``name`` (``images/00003.png``) of the seed-0 synthetic set of ``task`` (``data.tiny_task``; the
    tool tasks draw other images than the shapes') is: any written copy holds it."""
    if Path(name).is_absolute():
        return Path(name)
    pattern = "tiny-data-n*-s0-v2" if task == "shapes" else f"tiny-{task}-n*-s0-v1"
    for folder in sorted(cache_root().glob(pattern)):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"{name} is in no written copy of the tiny {task} training set under {cache_root()}")


class ShapesZoom:
    """One completion's environment: the row's image, and the quadrants the model zoomed into."""

    def reset(self, images=(), tiny_task: str = "shapes", **row) -> str:
        """Load the row's image (from the set its ``tiny_task`` column names); a shapes prompt gets a line naming the
        tool, a tool question none (it is the prompt the tool SFT learned to call from, word for word)."""
        self.image = Image.open(tiny_image(images[0], tiny_task)).convert("RGB") if images else None
        self.zooms: list[str] = []
        return "\nYou may zoom into a quadrant." if tiny_task == "shapes" else ""

    def zoom(self, quadrant: str) -> Image.Image:
        """Zoom into one quadrant of the image.

        Args:
            quadrant: top left, top right, bottom left or bottom right.
        """
        if self.image is None:
            raise ValueError("this row has no image")
        if quadrant not in POSITIONS:
            raise ValueError(f"quadrant must be one of {', '.join(POSITIONS)}, got {quadrant!r}")
        self.zooms.append(quadrant)
        return zoom_crop(self.image, quadrant)


def shape_colour(name: str) -> str:
    """The RGB value of a colour the shapes are drawn in.

    Args:
        name: the colour's name (red, green, blue, ...).
    """
    if name not in COLOURS:
        raise ValueError(f"no shape is drawn in {name!r}; the colours are {', '.join(COLOURS)}")
    return str(list(COLOURS[name]))


def zoomed(prediction: str, reference: str, environments: list[ShapesZoom] = (), **row) -> float:
    """1 when the trajectory zoomed at least once (its environment, TRL's ``environments[0]`` here, says), else 0."""
    return float(bool(environments) and bool(environments[0].zooms))


__all__ = ["ZOOM_SIDE", "ShapesZoom", "shape_colour", "tiny_image", "zoomed"]
