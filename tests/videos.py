"""Synthetic videos for the tests, written with PyAV: a square and a disc moving over a gradient.

Frame ``i`` also carries its own index in the blue channel of the top-left 4x4 block, so a test
can read back which frames were sampled. Lossless codecs (``ffv1``) keep that exact; the lossy
ones (mpeg4, h264, vp8) are there to test containers and decoding, not pixel values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CODECS = {  # suffix -> (codec, pix_fmt, stream options)
    ".mp4": ("libx264", "yuv420p", {"preset": "ultrafast"}),
    ".avi": ("mpeg4", "yuv420p", {}),
    ".mkv": ("ffv1", "bgr0", {}),
    ".webm": ("libvpx", "yuv420p", {}),
    ".mov": ("mpeg4", "yuv420p", {}),
}
LOSSLESS = ("ffv1", "bgr0", {})


def frame(i: int, width: int, height: int) -> np.ndarray:
    """Frame ``i``: ``[H, W, 3]`` uint8 with moving shapes; blue of the top-left 4x4 block = ``i % 256``."""
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), np.full_like(x, 60)], -1)
    side = max(4, min(width, height) // 4)
    sx = (i * 5) % max(width - side, 1)
    img[height // 3 : height // 3 + side, sx : sx + side] = (240, 40, 40)
    cx, cy, r = width - 1 - (i * 3) % width, (i * 2) % height, max(3, side // 2)
    img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = (40, 220, 60)
    img[:4, :4] = (0, 0, i % 256)
    return img.astype(np.uint8)


def write_video(
    path: Path, width: int, height: int, frames: int, fps: int, codec: tuple | None = None, truncate: float = 0.0
) -> Path:
    """Encode ``frames`` frames at ``fps``; the codec follows the suffix unless given.
    ``truncate`` > 0 cuts that fraction off the end of the file afterwards."""
    import av

    name, pix_fmt, options = codec or CODECS[path.suffix]
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(name, rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for i in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame(i, width, height), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * (1 - truncate))])
    return path


def decode_all(path: Path) -> tuple[list[np.ndarray], float]:
    """Every frame as RGB and the stream's average rate, read here independently of qwenkit."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return [f.to_ndarray(format="rgb24") for f in container.decode(stream)], float(stream.average_rate)
