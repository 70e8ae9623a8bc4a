"""Image entries → files or bytes → checked RGB images, and the grid Qwen2-VL will cut them into.

An image entry in a row may be

- a path: absolute, or relative to ``data.image_dir`` when set, else to the dataset file's
  directory (LLaMA-Factory's and ms-swift's convention);
- embedded bytes: a ``data:image/...;base64,...`` string, or an HF ``Image`` column value
  ``{"bytes": ..., "path": ...}`` (``path`` alone is resolved like a path).

:func:`predict_grid` gives the ``(t, h, w)`` patch grid the image processor will produce from
the image size alone, so the dataset scan knows every sample's token count without running
the (slow) pixel pipeline; the dataset checks the prediction against the processor later.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from qwenkit.data.report import BadSample, Location
from qwenkit.processor import ImageProcessor, pixel_bounds

# smart_resize from the module of the image-processor class in use (its location differs
# between transformers 4.57 and 5.x, and 5.x's other copy imports torchvision).
smart_resize = importlib.import_module(ImageProcessor.__module__).smart_resize


@dataclass(frozen=True)
class ImageRef:
    """Where one image's bytes come from. ``label`` is how error messages name it."""

    label: str
    path: Path | None = None
    data: bytes | None = None


def resolve(
    entries: list[Any], where: Location, base_dir: Path | None, image_dir: str | None, kind: str = "image"
) -> list[ImageRef]:
    """``kind`` ("image" or "video") names the entries in messages and picks the data-URI prefix
    and bad-sample reason; videos resolve exactly like images (see :mod:`qwenkit.data.video`)."""
    base = Path(image_dir).expanduser() if image_dir else base_dir
    return [_resolve_one(e, f"{kind} {k} of {len(entries)}", where, base, kind) for k, e in enumerate(entries)]


def _resolve_one(entry: Any, label: str, where: Location, base: Path | None, kind: str) -> ImageRef:
    if isinstance(entry, dict):
        if entry.get("bytes"):
            name = f" ({entry['path']!r})" if entry.get("path") else ""
            return ImageRef(f"{label}{name}", data=entry["bytes"])
        entry = entry.get("path")
    if isinstance(entry, bytes):
        return ImageRef(f"{label} (embedded bytes)", data=entry)
    if not isinstance(entry, str) or not entry:
        raise BadSample(
            where,
            "bad_format",
            f"{label} must be a path, base64 data URI or {{bytes, path}}, got {entry!r:.80}",
        )
    if entry.startswith(f"data:{kind}/"):
        try:
            return ImageRef(
                f"{label} (data URI)", data=base64.b64decode(entry.split(",", 1)[1], validate=True)
            )
        except (IndexError, binascii.Error) as e:
            raise BadSample(where, f"corrupt_{kind}", f"{label}: bad base64 data URI ({e})") from None
    path = Path(entry).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    return ImageRef(f"{label} ({entry!r})", path=path)


def load(ref: ImageRef, where: Location) -> Image.Image:
    """Decode the whole image (so truncation shows) and return it as RGB."""
    try:
        return _decode(ref)
    except _Unreadable as e:
        raise BadSample(where, e.reason, f"{ref.label}: {e.detail}") from None


class _Unreadable(Exception):
    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


def _decode(ref: ImageRef) -> Image.Image:
    """The fully decoded image as RGB, converted while the file is still open."""
    if ref.data is None and not ref.path.is_file():
        raise _Unreadable("missing_image", f"no such file {str(ref.path)!r}")
    source = io.BytesIO(ref.data) if ref.data is not None else ref.path
    try:
        with Image.open(source) as im:
            im.load()
            return im.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise _Unreadable("corrupt_image", f"cannot decode: {e}") from None


def check_shape(
    size: tuple[int, int], ref: ImageRef, where: Location, min_side: int, max_aspect_ratio: float
) -> None:
    w, h = size
    if min(w, h) < min_side:
        raise BadSample(
            where, "small_image", f"{ref.label} is {w}x{h} px, a side below data.min_image_side={min_side}"
        )
    ratio = max(w, h) / min(w, h)
    if ratio > max_aspect_ratio:
        raise BadSample(
            where,
            "aspect_ratio",
            f"{ref.label} is {w}x{h} px, aspect ratio {ratio:.1f} > data.max_aspect_ratio={max_aspect_ratio:g}",
        )


def predict_grid(size: tuple[int, int], image_processor) -> tuple[int, int, int]:
    """The ``(t, h, w)`` patch grid the Qwen2-VL image processor makes of a ``size=(w, h)`` image."""
    w, h = size
    lo, hi = pixel_bounds(image_processor)
    patch = image_processor.patch_size
    rh, rw = smart_resize(h, w, factor=patch * image_processor.merge_size, min_pixels=lo, max_pixels=hi)
    return 1, rh // patch, rw // patch  # a still image is one temporal patch (the frame is repeated)


class ImageProbe:
    """Decode-and-measure with a cache: datasets often reuse one image file in many rows."""

    def __init__(self, min_side: int, max_aspect_ratio: float):
        self.min_side, self.max_aspect_ratio = min_side, max_aspect_ratio
        self._seen: dict[Path, tuple[int, int] | _Unreadable] = {}

    def size(self, ref: ImageRef, where: Location) -> tuple[int, int]:
        """The checked ``(w, h)`` of an image; raises :class:`BadSample` as :func:`load` and :func:`check_shape`."""
        key = ref.path if ref.data is None else None
        result = self._seen.get(key) if key is not None else None
        if result is None:
            try:
                result = _decode(ref).size
            except _Unreadable as e:
                result = e
            if key is not None:
                self._seen[key] = result
        if isinstance(result, _Unreadable):
            raise BadSample(where, result.reason, f"{ref.label}: {result.detail}")
        check_shape(result, ref, where, self.min_side, self.max_aspect_ratio)
        return result
