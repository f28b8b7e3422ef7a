"""Frames of a video file or stream as JPEGs, sampled at a frame rate (PyAV; ``pip install
vllm-realtime-client[video]``).  :meth:`RealtimeSession.stream_video` sends them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from fractions import Fraction
from typing import Any


def _av() -> Any:
    try:
        import av
    except ImportError as exc:  # an optional dependency: say how to get it
        raise ImportError(
            "stream_video needs PyAV: pip install 'vllm-realtime-client[video]'"
        ) from exc
    return av


def sample_jpegs(
    source: str | os.PathLike[str],
    *,
    fps: float,
    width: int | None = None,
    height: int | None = None,
    quality: int = 5,
) -> Iterator[tuple[float, bytes]]:
    """``(seconds into the video, JPEG bytes)`` for one frame every ``1/fps`` seconds of video
    time: the first frame at or after each tick.  ``width``/``height`` scale the frames (one
    of them alone keeps the aspect ratio); ``quality`` is the MJPEG qscale (2 best … 31).

    ``source`` is anything FFmpeg opens: a file, or a URL (rtsp://, http://)."""
    if fps <= 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    av = _av()
    with av.open(os.fspath(source)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        encoder = None
        next_tick = 0.0
        for frame in container.decode(stream):
            if frame.pts is None or frame.time_base is None:
                continue
            t = float(frame.pts * Fraction(frame.time_base))
            if t + 1e-6 < next_tick:
                continue
            next_tick = t + 1.0 / fps
            out_w, out_h = _size(frame.width, frame.height, width, height)
            image = frame.reformat(width=out_w, height=out_h, format="yuvj420p")
            if encoder is None:
                encoder = av.CodecContext.create("mjpeg", "w")
                encoder.width, encoder.height = out_w, out_h
                encoder.pix_fmt = "yuvj420p"
                encoder.time_base = Fraction(1, 1000)
                encoder.options = {"qscale": str(quality)}
                encoder.qscale = quality  # where the option is not read
            packets = encoder.encode(image)
            yield t, b"".join(bytes(p) for p in packets)


def _size(w: int, h: int, width: int | None, height: int | None) -> tuple[int, int]:
    if width and height:
        return width, height
    if width:
        return width, max(2, round(h * width / w / 2) * 2)
    if height:
        return max(2, round(w * height / h / 2) * 2), height
    return w, h
