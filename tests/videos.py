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


def write_heard_video(
    path: Path, width: int, height: int, frames: int, fps: int, hz: float = 440.0, rate: int = 16_000,
    garbage: bool = False,
) -> Path:
    """A lossless video (ffv1) with an audio track (flac, mono) of a ``hz`` sine as long as the frames; ``garbage``:
    the audio packets replaced by random bytes of their size, so the frames decode and the audio does not."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    samples = rate * frames // fps
    wave = (0.5 * np.sin(2 * np.pi * hz * np.arange(samples) / rate) * 32767).astype(np.int16)
    rng = np.random.default_rng(0)
    with av.open(str(path), "w", format="matroska") as container:
        video = container.add_stream(LOSSLESS[0], rate=fps)
        video.width, video.height, video.pix_fmt = width, height, LOSSLESS[1]
        sound = container.add_stream("flac", rate=rate, layout="mono")
        for i in range(frames):
            for packet in video.encode(av.VideoFrame.from_ndarray(frame(i, width, height), format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        for start in range(0, samples, 1024):
            piece = av.AudioFrame.from_ndarray(wave[None, start : start + 1024].copy(), format="s16", layout="mono")
            piece.sample_rate, piece.pts = rate, start
            for packet in sound.encode(piece):
                if garbage:
                    bad = av.Packet(rng.integers(0, 256, packet.size, dtype=np.uint8).tobytes())
                    bad.stream, bad.pts, bad.dts, bad.time_base = packet.stream, packet.pts, packet.dts, packet.time_base
                    packet = bad
                container.mux(packet)
        for packet in sound.encode(None):
            container.mux(packet)
    return path
