"""The frames every mode of the benchmark gets: deterministic, so all modes see the same input."""

from __future__ import annotations

import io
from functools import lru_cache

from protocol.state import Frame

INSTRUCTIONS = (
    "You watch a camera feed, one frame at a time. After each frame, say in a few words what "
    "changed."
)

_COLORS = ("red", "blue", "green", "white", "black", "yellow", "grey")
_THINGS = ("car", "bicycle", "dog", "delivery van", "person with an umbrella", "bus", "cat")
_ACTIONS = ("moves left", "moves right", "stops", "turns around", "waits", "speeds up")
_PLACES = ("gate", "crossing", "bakery", "parked truck", "fountain", "bus stop", "old mill")


def frame_text(i: int, stream: int = 0) -> str:
    """Text turn `i` of camera `stream` (~25 SmolLM2 tokens)."""
    return (
        f"Camera {stream}, frame {i}: a {_COLORS[i % 7]} {_THINGS[(i // 7) % 7]} "
        f"{_ACTIONS[(i + stream) % 6]} near the {_PLACES[(i // 3 + stream) % 7]}."
    )


def text_frame(i: int, stream: int = 0) -> Frame:
    text = frame_text(i, stream)
    return Frame(
        frame_index=i,
        frame_id=f"s{stream}-f{i}",
        kind="text",
        media_format=None,
        data=text.encode(),
        text=text,
        prompt=None,
        timestamp=None,
    )


@lru_cache(maxsize=64)
def frame_jpeg(i: int, stream: int = 0, size: int = 224) -> bytes:
    """A synthetic camera frame: a square that moves across a gradient background."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (40 + (stream * 37) % 160, 90, 140))
    draw = ImageDraw.Draw(img)
    for y in range(0, size, 8):
        draw.rectangle((0, y, size, y + 7), fill=(40 + y % 200, 80 + (y * 3) % 150, 120))
    side = size // 5
    x = (i * 9) % (size - side)
    y = (i * 5 + stream * 11) % (size - side)
    draw.rectangle((x, y, x + side, y + side), fill=(240, 200 - (i * 7) % 150, 30))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def image_frame(i: int, stream: int = 0, size: int = 224) -> Frame:
    return Frame(
        frame_index=i,
        frame_id=f"s{stream}-f{i}",
        kind="image",
        media_format="jpeg",
        data=frame_jpeg(i, stream, size),
        text=None,
        prompt=None,
        timestamp=float(i),
    )
