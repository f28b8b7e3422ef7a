"""A real uvicorn server on loopback, in the test session's event loop, over the shared engine."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def jpeg_bytes(seed: int = 0, size: int = 112) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=80)
    return buf.getvalue()


@dataclass
class RunningServer:
    url: str
    http: str
    app: object
    api_key: str | None

    @property
    def hub(self):  # type: ignore[no-untyped-def]
        return self.app.state.hub  # type: ignore[attr-defined]


async def _serve(
    engine: object,
    api_key: str | None,
    model_name: str = "tiny-qwen2-vl",
    port: int | None = None,
    **cfg: object,
) -> AsyncIterator[RunningServer]:
    import uvicorn

    from realtime.config import ServerConfig
    from realtime.hub import SessionHub
    from realtime.server import WS_IMPLEMENTATION, create_app

    port = port or free_port()
    # The shared engines have a 1024-token context: with the default 128-token chunk cap a
    # client budget of a few chunks would not fit (realtime/admission.py). Test chunks are short.
    cfg.setdefault("max_chunk_tokens", 64)
    # Admission by compute measures the engine: its verdicts depend on the machine's load, so
    # tests that open many sessions for other reasons leave it off; tests/realtime/
    # test_camera_admission.py turns it on (with an injected cost where it decides).
    cfg.setdefault("compute_headroom", None)
    config = ServerConfig(port=port, api_key=api_key, **cfg)  # type: ignore[arg-type]

    async def hub_factory() -> SessionHub:
        hub = SessionHub(engine, config, model_name=model_name)
        await hub.start()
        return hub

    app = create_app(hub_factory, config)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws=WS_IMPLEMENTATION)
    )
    task = asyncio.create_task(server.serve())
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.05)
    assert server.started
    yield RunningServer(
        f"ws://127.0.0.1:{port}/v1/realtime", f"http://127.0.0.1:{port}", app, api_key
    )
    server.should_exit = True
    await asyncio.wait_for(task, timeout=30)


@pytest.fixture(scope="session")
async def server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    async for s in _serve(
        vlm_engine, None, max_sessions=8, idle_timeout_s=30.0, max_frame_bytes=1 << 20
    ):
        yield s


@pytest.fixture(scope="session")
async def keyed_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    async for s in _serve(vlm_engine, "sekret-key", max_sessions=4):
        yield s


@pytest.fixture(scope="session")
async def text_server(smollm2_engine: object) -> AsyncIterator[RunningServer]:
    async for s in _serve(smollm2_engine, None, model_name="smollm2-135m-instruct", max_sessions=4):
        yield s


# WebSocket helpers shared by the end-to-end and reliability tests.
SUBPROTOCOLS = ["vllm-realtime"]


async def recv(ws: Any, timeout: float = 60) -> dict[str, Any]:
    message = await asyncio.wait_for(ws.recv(), timeout)
    assert isinstance(message, str), "the server sends text messages only"
    event: dict[str, Any] = json.loads(message)
    return event


async def recv_until(
    ws: Any, kind: str, timeout: float = 60
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    while True:
        ev = await recv(ws, timeout)
        seen.append(ev)
        if ev["type"] == kind:
            return ev, seen


async def open_session(ws: Any, **fields: Any) -> dict[str, Any]:
    hello = await recv(ws)
    assert hello["type"] == "session.created"
    fields.setdefault("sampling", {"max_tokens": 4})
    await ws.send(json.dumps({"type": "session.open", **fields}))
    opened = await recv(ws)
    assert opened["type"] == "session.opened", opened
    return opened


# A bounded text session that evicts within a few turns: the instructions chunk pinned, a
# window of 2 chunks, 2-token replies.
BOUNDED_TEXT: dict[str, Any] = {
    "modality": "text",
    "retention": {"sink_chunks": 1, "window_chunks": 2},
    "sampling": {"max_tokens": 2},
}


def image_event(seed: int, **extra: Any) -> str:
    """A `frame.append` event carrying `jpeg_bytes(seed)`."""
    return json.dumps(
        {"type": "frame.append", "image": base64.b64encode(jpeg_bytes(seed)).decode(), **extra}
    )


def camera_jpeg(i: int) -> bytes:
    """A 640x480 webcam-like JPEG (the model reads it as 12 tokens), different per frame."""
    from training.synth_frames import FrameSpec, draw_frame

    colours = ["red", "green", "blue", "yellow"]
    spec = FrameSpec(colours[i % 4], ["circle", "square"][i % 2], 1 + i % 3, "white")
    img, _ = draw_frame(spec, random.Random(i), (640, 480))
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=85)
    return out.getvalue()
