"""Synthetic frames drawn with Pillow, with the facts a reply should name.

A frame is a plain background with 1–3 shapes of one colour and one kind at random positions
(sizes and positions vary, shapes never overlap), optionally a digit drawn in a corner. Each frame
comes with its `FrameSpec` (colour, shape, count, background) and a per-pixel object mask, which
the vision training uses to tell object patches from background patches. `pacman_frame` draws a
frame like Chromium's fake camera (`--use-fake-device-for-media-stream`): dark green, a sweeping
pac-man, a timer and grey corner squares.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass
from typing import Any

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 20),
    "purple": (140, 40, 180),
    "orange": (245, 140, 20),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    **COLOURS,
}
NEUTRAL_BACKGROUNDS = ("white", "black")
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
# Source sizes the frames are drawn at (the processor then resizes them as it would a client's).
SIZES = ((112, 112), (224, 224), (320, 240), (240, 320), (160, 120), (640, 480), (168, 112))


@dataclass(frozen=True)
class FrameSpec:
    colour: str
    shape: str
    count: int
    background: str
    digit: int | None = None


def random_spec(rng: random.Random, coloured_background: float = 0.35) -> FrameSpec:
    """Shapes on white or black, or (with probability `coloured_background`) on a colour."""
    colour = rng.choice(list(COLOURS))
    if rng.random() >= coloured_background:
        background = rng.choice(NEUTRAL_BACKGROUNDS)
    else:
        background = rng.choice([c for c in COLOURS if c != colour])
    digit = rng.randrange(10) if rng.random() < 0.2 else None
    return FrameSpec(colour, rng.choice(SHAPES), rng.randint(1, 3), background, digit)


def _draw_shape(draw: Any, shape: str, box: tuple[float, float, float, float], fill: Any) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


def _jitter(rgb: tuple[int, int, int], rng: random.Random, by: int = 30) -> tuple[int, ...]:
    """Lighting varies: each channel moves by up to `by`."""
    return tuple(max(0, min(255, c + rng.randint(-by, by))) for c in rgb)


def draw_frame(spec: FrameSpec, rng: random.Random, size: tuple[int, int] | None = None) -> Any:
    """(RGB image, L mask with 255 on the shapes) for `spec`, at `size` or a random one."""
    from PIL import Image, ImageDraw

    w, h = size or rng.choice(SIZES)
    img = Image.new("RGB", (w, h), _jitter(BACKGROUNDS[spec.background], rng))
    mask = Image.new("L", (w, h), 0)
    d, dm = ImageDraw.Draw(img), ImageDraw.Draw(mask)
    short = min(w, h)
    boxes: list[tuple[float, float, float, float]] = []
    for _ in range(spec.count):
        for _attempt in range(200):
            side = short * rng.uniform(0.22, 0.36 if spec.count > 1 else 0.55)
            x0, y0 = rng.uniform(0, w - side), rng.uniform(0, h - side)
            box = (x0, y0, x0 + side, y0 + side)
            gap = short * 0.04
            if all(
                box[2] + gap < b[0]
                or b[2] + gap < box[0]
                or box[3] + gap < b[1]
                or b[3] + gap < box[1]
                for b in boxes
            ):
                boxes.append(box)
                break
        else:
            raise RuntimeError("no room for the shapes")  # never with these sizes
    fill = _jitter(COLOURS[spec.colour], rng)
    for box in boxes:
        _draw_shape(d, spec.shape, box, fill)
        _draw_shape(dm, spec.shape, box, 255)
    if spec.digit is not None:
        ink = (0, 0, 0) if spec.background in ("white", "yellow", "orange") else (255, 255, 255)
        d.text((2, 2), str(spec.digit), fill=ink)
    return img, mask


def pacman_frame(size: tuple[int, int] = (640, 480), t: float = 1.3) -> Any:
    """A frame like Chromium's fake camera at time `t` seconds: green, a pac-man, a timer."""
    from PIL import Image, ImageDraw

    w, h = size
    img = Image.new("RGB", (w, h), (0, 127, 0))
    d = ImageDraw.Draw(img)
    r = min(w, h) // 4
    end = math.fmod(600 * t, 361)
    d.pieslice((w / 2 - r, h / 2 - r, w / 2 + r, h / 2 + r), 0, end, fill=(230, 230, 40))
    side = w // 16
    for x, y in ((0, 0), (w - side, 0), (0, h - side), (w - side, h - side)):
        d.rectangle((x, y, x + side - 1, y + side - 1), fill=(128, 128, 128))
    stamp = f"0:00:{int(t):02d}:{int(t * 1000) % 1000:03d} {int(t * 30)}"
    d.text((90, 60), stamp, fill=(0, 255, 0))
    return img


# Frames as the server receives them: through JPEG, then the model's processor. Both the code
# tuning (vision_codes) and the tower training (vision_train) read frames this way.
def jpeg(img: Any, rng: random.Random) -> Any:
    """What the server decodes: frames arrive as JPEG."""
    from PIL import Image

    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=rng.randint(60, 95))
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


def processor() -> Any:
    """The image processor of `smol-qwen2-vl`, as the server builds it."""
    from transformers import Qwen2VLImageProcessor

    from realtime.models.smol_vlm import MAX_PIXELS, MERGE_SIZE, MIN_PIXELS, PATCH_SIZE

    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    return Qwen2VLImageProcessor(size=size, patch_size=PATCH_SIZE, merge_size=MERGE_SIZE)
