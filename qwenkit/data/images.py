"""Image entries → files or bytes → checked RGB images, and the grid Qwen2-VL will cut them into.

An image entry in a row may be

- a path: absolute, or relative to ``data.image_dir`` when set, else to the dataset file's
  directory (LLaMA-Factory's and ms-swift's convention);
- embedded bytes: a ``data:image/...;base64,...`` string, or an HF ``Image`` column value
  ``{"bytes": ..., "path": ...}`` (``path`` alone is resolved like a path);
- a ``file://`` URI (qwen-vl-utils); ``http(s)://`` URLs are bad samples: nothing is fetched.

Images are converted to RGB by transformers' own ``convert_to_rgb``, as its image processors do
(5.x composites transparent pixels on white), so training sees what HF's processor feeds the model.

:func:`predict_grid` gives the ``(t, h, w)`` patch grid the image processor will produce from
the image size alone, so the dataset scan knows every sample's token count without running
the (slow) pixel pipeline; the dataset checks the prediction against the processor later.

The scan measures images in one of two ways (``data.verify_images``):

- ``header`` (default): the size from the file header, plus, for JPEG and PNG, the file's
  end marker (``FFD9``, ``IEND``), so a truncated file — the common corruption, a copy cut
  short — is still found at scan time for the price of reading a few bytes. A file without its
  marker is decoded in full before it is called corrupt (some writers append padding).
  Corruption inside the compressed data shows only when the sample is loaded, where
  ``data.on_bad_sample`` handles it (see :class:`qwenkit.data.dataset.EncodedDataset`).
- ``full``: every image decoded in full (what ``qwenkit data check`` always does).
"""

from __future__ import annotations

import base64
import binascii
import importlib
import inspect
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from PIL import Image
from transformers.image_transforms import convert_to_rgb

from qwenkit.data.report import BadSample, Location
from qwenkit.model.processor import ImageProcessor, pixel_bounds

# smart_resize from the module of the image-processor class in use (its location differs
# between transformers 4.57 and 5.x, and 5.x's other copy imports torchvision).
smart_resize = importlib.import_module(ImageProcessor.__module__).smart_resize

T = TypeVar("T")
_RGB_RETURNS_NUMPY = "return_numpy" in inspect.signature(convert_to_rgb).parameters  # transformers 5.x


@dataclass(frozen=True)
class MediaRef:
    """Where one image's or video's bytes come from (a file, or bytes embedded in the row). ``label`` is how error messages name it."""

    label: str
    path: Path | None = None
    data: bytes | None = None
    frames: tuple[MediaRef, ...] | None = None  # a video given as its frame files (qwenkit.data.video)
    fps: float | None = None  # the frame rate of ``frames`` as the row gives it (None: data.video_fps)


def resolve(
    entries: list[Any], where: Location, base_dir: Path | None, image_dir: str | None, kind: str = "image"
) -> list[MediaRef]:
    """``kind`` ("image" or "video") names the entries in messages and picks the data-URI prefix
    and bad-sample reason; videos resolve exactly like images (see :mod:`qwenkit.data.video`)."""
    base = Path(image_dir).expanduser() if image_dir else base_dir
    return [_resolve_one(e, f"{kind} {k} of {len(entries)}", where, base, kind) for k, e in enumerate(entries)]


def _resolve_one(entry: Any, label: str, where: Location, base: Path | None, kind: str) -> MediaRef:
    if kind == "video" and isinstance(entry, list):  # LLaMA-Factory: "videos": [["f0.jpg", "f1.jpg", ...]]
        entry = {"frames": entry, "fps": None}
    if kind == "video" and isinstance(entry, dict) and isinstance(entry.get("frames"), list):
        frames = entry["frames"]
        if not frames:
            raise BadSample(where, "short_video", f"{label} is an empty list of frames")
        refs = tuple(_resolve_one(f, f"{label} frame {k}", where, base, "image") for k, f in enumerate(frames))
        return MediaRef(f"{label} ({len(frames)} frame files)", frames=refs, fps=entry.get("fps"))
    if isinstance(entry, dict):
        if entry.get("bytes"):
            name = f" ({entry['path']!r})" if entry.get("path") else ""
            return MediaRef(f"{label}{name}", data=entry["bytes"])
        entry = entry.get("path")
    if isinstance(entry, bytes):
        return MediaRef(f"{label} (embedded bytes)", data=entry)
    if not isinstance(entry, str) or not entry:
        raise BadSample(
            where,
            "bad_format",
            f"{label} must be a path, base64 data URI or {{bytes, path}}, got {entry!r:.80}",
        )
    if entry.startswith(f"data:{kind}"):  # data:image/png;base64,... (qwen-vl-utils also data:image;base64,)
        try:
            return MediaRef(
                f"{label} (data URI)", data=base64.b64decode(entry.split(",", 1)[1], validate=True)
            )
        except (IndexError, binascii.Error) as e:
            raise BadSample(where, f"corrupt_{kind}", f"{label}: bad base64 data URI ({e})") from None
    if entry.startswith(("http://", "https://")):
        raise BadSample(
            where, "media_url", f"{label} is a URL ({entry:.100}); URLs are not fetched; download the files and give paths"
        )
    if entry.startswith("file://"):
        entry = entry[len("file://") :]
    path = Path(entry).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    return MediaRef(f"{label} ({entry!r})", path=path)


def load(ref: MediaRef, where: Location) -> Image.Image:
    """Decode the whole image (so truncation shows) and return it as RGB."""
    try:
        return decode_rgb(ref)
    except Unreadable as e:
        raise e.bad_sample(ref, where) from None


class Unreadable(Exception):
    """Why an image or video file cannot be read: a bad-sample reason and its detail, no location yet."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail

    def bad_sample(self, ref: MediaRef, where: Location) -> BadSample:
        return BadSample(where, self.reason, f"{ref.label}: {self.detail}")


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB exactly as the installed transformers' image processors make it (``convert_to_rgb``):
    5.x composites transparency (alpha, or a palette/RGB ``transparency`` entry) on white; 4.57
    converts plainly. Training then sees the pixels HF's processor gives the deployed model."""
    if _RGB_RETURNS_NUMPY:
        return Image.fromarray(convert_to_rgb(im, return_numpy=True))
    return convert_to_rgb(im)


def decode_rgb(ref: MediaRef) -> Image.Image:
    """The fully decoded image as RGB, converted while the file is still open."""
    if ref.data is None and not ref.path.is_file():
        raise Unreadable("missing_image", f"no such file {str(ref.path)!r}")
    source = io.BytesIO(ref.data) if ref.data is not None else ref.path
    try:
        with Image.open(source) as im:
            im.load()
            return to_rgb(im)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise Unreadable("corrupt_image", f"cannot decode: {e}") from None


# bytes that must appear near the end of a complete file, by PIL format name
END_MARKERS = {"JPEG": b"\xff\xd9", "PNG": b"IEND", "MPO": b"\xff\xd9"}
END_WINDOW = 64  # how far from the end the marker may sit (writers may pad after it)


def _measure(ref: MediaRef, full: bool) -> tuple[int, int]:
    """The ``(w, h)`` of an image: decoded in full, or read from the header and end marker."""
    if full:
        return decode_rgb(ref).size
    if ref.data is None and not ref.path.is_file():
        raise Unreadable("missing_image", f"no such file {str(ref.path)!r}")
    try:
        with Image.open(io.BytesIO(ref.data) if ref.data is not None else ref.path) as im:
            size, marker = im.size, END_MARKERS.get(im.format)
            if marker is None:
                return size
            fp = im.fp
            fp.seek(0, io.SEEK_END)
            fp.seek(max(0, fp.tell() - END_WINDOW))
            if marker in fp.read():
                return size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise Unreadable("corrupt_image", f"cannot decode: {e}") from None
    return decode_rgb(ref).size  # no end marker: the decoder says whether the file is really cut short


def check_shape(
    size: tuple[int, int], ref: MediaRef, where: Location, min_side: int, max_aspect_ratio: float
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


class CachedProbe(Generic[T]):
    """``measure(ref)`` once per file: datasets often reuse one image or clip in many rows.

    Files are keyed by path (embedded bytes are measured each time). A file that cannot be read
    is remembered too, and raised as a :class:`BadSample` at every row that uses it.
    """

    def __init__(self, measure: Callable[[MediaRef], T]):
        self._measure = measure
        self._seen: dict[Path, T | Unreadable] = {}

    def __call__(self, ref: MediaRef, where: Location) -> T:
        key = ref.path if ref.data is None else None
        result = self._seen.get(key) if key is not None else None
        if result is None:
            try:
                result = self._measure(ref)
            except Unreadable as e:
                result = e
            if key is not None:
                self._seen[key] = result
        if isinstance(result, Unreadable):
            raise result.bad_sample(ref, where)
        return result


class ImageProbe:
    """Measure-and-check with a cache (:class:`CachedProbe`).

    ``full``: decode every image in full instead of reading its header and end marker.
    """

    def __init__(self, min_side: int, max_aspect_ratio: float, full: bool = False):
        self.min_side, self.max_aspect_ratio = min_side, max_aspect_ratio
        self._sizes = CachedProbe(lambda ref: _measure(ref, full))

    def size(self, ref: MediaRef, where: Location) -> tuple[int, int]:
        """The checked ``(w, h)`` of an image; raises :class:`BadSample` as :func:`load` and :func:`check_shape`."""
        size = self._sizes(ref, where)
        check_shape(size, ref, where, self.min_side, self.max_aspect_ratio)
        return size
