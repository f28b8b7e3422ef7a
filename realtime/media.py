"""Decode chunk payloads (images, short clips) for the engine; errors become protocol errors.

A frame larger than the session's frame cap (`max_frame_pixels`) is resized down to it, its
aspect kept, as a camera service is expected to: admission reserved a frame's tokens from the
cap, and the processor is told the same cap (realtime/engine.py), so no frame becomes more
tokens than were reserved. The resize is reported (`FrameResize`) in the chunk's response.done.
"""

from __future__ import annotations

import io
import math
from typing import Any

from vllm_realtime_protocol import UndecodableFrame

MAX_CLIP_FRAMES = 16
# The server's default frame cap, 448×448 pixels: the page's 224-px camera frames go to the
# model as sent, a 640×480 one at 517×388. A default camera session on a published Qwen-VL
# config (16 megapixels) then reserves about what a camera frame is, and fits a 2,048 context.
DEFAULT_MAX_FRAME_PIXELS = 448 * 448
# A clip whose container names no frame rate is read at Qwen-VL's default sampling rate.
DEFAULT_CLIP_FPS = 2.0
MAX_IMAGE_PIXELS = 4096 * 4096  # refuse decompression bombs before decoding
# A clip's frames together: without a total, 16 frames of 4096×4096 passed the per-frame check
# and a few-kB clip decoded to ~800 MB of RGB (twice that once stacked) per session.
MAX_CLIP_PIXELS = 2 * MAX_IMAGE_PIXELS
# The Qwen-VL processors raise on more than 200:1 (smart_resize); that ValueError came back as a
# fatal engine_error that closed the session. Refused here instead, as undecodable_frame.
MAX_ASPECT_RATIO = 200


def _check_shape(width: int, height: int, event_id: str | None) -> None:
    if width * height > MAX_IMAGE_PIXELS:
        raise UndecodableFrame(
            f"image is {width}×{height}; at most {MAX_IMAGE_PIXELS} pixels", event_id=event_id
        )
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise UndecodableFrame(
            f"image is {width}×{height}; the aspect ratio may be at most {MAX_ASPECT_RATIO}:1",
            event_id=event_id,
        )


def fit_size(width: int, height: int, max_pixels: int | None) -> tuple[int, int]:
    """The size a frame is resized to under the cap: itself if it fits, else the largest size
    of the same aspect (rounded down, at least 1×1) with at most `max_pixels` pixels."""
    if max_pixels is None or width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    w, h = max(1, int(width * scale)), max(1, int(height * scale))
    while w * h > max_pixels:  # float rounding
        if w >= h:
            w -= 1
        else:
            h -= 1
    return w, h


def decode_image(data: bytes, event_id: str | None = None, max_pixels: int | None = None) -> Any:
    """An RGB PIL image, resized down to at most `max_pixels` (None: as sent)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            _check_shape(img.width, img.height, event_id)
            img.load()
            rgb = img.convert("RGB")
            size = fit_size(rgb.width, rgb.height, max_pixels)
            if size != (rgb.width, rgb.height):
                rgb = rgb.resize(size, Image.Resampling.BICUBIC)
            return rgb
    except UndecodableFrame:
        raise
    except Exception as exc:  # PIL raises many types for corrupt input
        raise UndecodableFrame(
            f"image could not be decoded ({type(exc).__name__})", event_id=event_id
        ) from None


def decode_clip(
    data: bytes,
    event_id: str | None = None,
    max_frames: int = MAX_CLIP_FRAMES,
    max_pixels: int = MAX_CLIP_PIXELS,
    max_frame_pixels: int | None = None,
) -> Any:
    """A short clip → ``(frames, metadata)``: a uint8 array (T, H, W, 3), T even (Qwen-VL pairs
    frames in time), and the metadata vLLM's Qwen2.5-VL and Qwen3-VL processors require
    ("Video metadata is required" otherwise): its frame rate, duration and frame indices, with
    the processor's own frame sampling off (the clip is what the client chose to send). Each
    frame larger than `max_frame_pixels` is resized down to it."""
    import av
    import numpy as np

    frames: list[Any] = []
    total = 0
    fps = DEFAULT_CLIP_FPS
    try:
        with av.open(io.BytesIO(data)) as container:
            rate = container.streams.video[0].average_rate
            if rate is not None and float(rate) > 0:
                fps = float(rate)
            for frame in container.decode(video=0):
                _check_shape(frame.width, frame.height, event_id)
                total += frame.width * frame.height
                if total > max_pixels:
                    raise UndecodableFrame(
                        f"clip has more than {max_pixels} pixels in all", event_id=event_id
                    )
                w, h = fit_size(frame.width, frame.height, max_frame_pixels)
                if (w, h) != (frame.width, frame.height):
                    frame = frame.reformat(width=w, height=h)
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
    decoded = len(frames)
    if decoded % 2:
        frames.append(frames[-1])
    metadata = {
        "fps": fps,
        "duration": decoded / fps,
        "total_num_frames": len(frames),
        "frames_indices": [*range(decoded), *([decoded - 1] if len(frames) > decoded else [])],
        "video_backend": "pyav",
        "do_sample_frames": False,
    }
    return np.stack(frames), metadata
