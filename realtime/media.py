"""Decode chunk payloads (images, short clips) for the engine; errors become protocol errors."""

from __future__ import annotations

import io
from typing import Any

from protocol import UndecodableFrame

MAX_CLIP_FRAMES = 16
MAX_IMAGE_PIXELS = 4096 * 4096  # refuse decompression bombs before decoding


def decode_image(data: bytes, event_id: str | None = None) -> Any:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise UndecodableFrame(
                    f"image is {img.width}×{img.height}; at most {MAX_IMAGE_PIXELS} pixels",
                    event_id=event_id,
                )
            img.load()
            return img.convert("RGB")
    except UndecodableFrame:
        raise
    except Exception as exc:  # PIL raises many types for corrupt input
        raise UndecodableFrame(
            f"image could not be decoded ({type(exc).__name__})", event_id=event_id
        ) from None


def decode_clip(data: bytes, event_id: str | None = None, max_frames: int = MAX_CLIP_FRAMES) -> Any:
    """A short clip → uint8 array (T, H, W, 3), T even (Qwen-VL pairs frames in time)."""
    import av
    import numpy as np

    frames: list[Any] = []
    try:
        with av.open(io.BytesIO(data)) as container:
            for frame in container.decode(video=0):
                if frame.width * frame.height > MAX_IMAGE_PIXELS:
                    raise UndecodableFrame("clip frames are too large", event_id=event_id)
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) >= max_frames:
                    break
    except UndecodableFrame:
        raise
    except Exception as exc:
        raise UndecodableFrame(
            f"clip could not be decoded ({type(exc).__name__})", event_id=event_id
        ) from None
    if not frames:
        raise UndecodableFrame("clip has no video frames", event_id=event_id)
    if len(frames) % 2:
        frames.append(frames[-1])
    return np.stack(frames)
