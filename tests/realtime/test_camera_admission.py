"""Camera admission on the real server: sessions are reserved for what they declare (single
images unless they declare clips), and admitted while the engine's time fits their pace.

Real uvicorn, real WebSockets, the real tiny VLM engine. Where admission decides by compute,
the cost of a chunk is injected (`chunk_cost_ms`): measured costs depend on the machine's load,
and the decision itself is tested in test_compute.py; here, that the server applies it.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import websockets

from realtime.hub import CALIBRATION_CHUNKS
from tests.realtime.conftest import (
    SUBPROTOCOLS,
    RunningServer,
    _serve,
    jpeg_bytes,
    open_session,
    recv,
    recv_until,
)
from vllm_realtime_protocol import SessionConfig

pytestmark = pytest.mark.slow

CAMERA: dict[str, Any] = {"retention": {"window_chunks": 2}, "sampling": {"max_tokens": 4}}


def image_event(seed: int) -> str:
    return json.dumps(
        {"type": "frame.append", "image": base64.b64encode(jpeg_bytes(seed)).decode()}
    )


def clip_event(frames: int) -> str:
    from tests.reliability.fuzzcore import _clip

    clip = base64.b64encode(_clip("mp4", "mpeg4", frames=frames, size=64)).decode()
    return json.dumps({"type": "frame.append", "video": clip})


def frames(hub: Any) -> float:
    """Chunks the server answered so far (its /metrics counter)."""
    return float(hub.metrics.registry.get_sample_value("vllm_realtime_frames_total"))


async def answered(ws: Any, event: str) -> dict[str, Any]:
    await ws.send(event)
    done, _ = await recv_until(ws, "response.done")
    assert done["status"] in ("completed", "incomplete"), done
    return done


async def test_declared_clips_are_reserved_and_undeclared_ones_refused(
    server: RunningServer,
) -> None:
    hub = server.hub
    clips = {**CAMERA, "limits": {"max_clip_frames": 16}}
    async with (
        websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as camera,
        websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as clipper,
    ):
        plain = await open_session(camera, **CAMERA)
        declared = await open_session(clipper, **clips)
        # Reserved for what each sends: one image a chunk, or a 16-frame clip a chunk.
        assert plain["config"]["limits"]["max_clip_frames"] == 1
        assert plain["reservation"]["kv_blocks"] == hub.reservation_blocks(SessionConfig(**CAMERA))
        assert declared["reservation"]["kv_blocks"] == hub.reservation_blocks(
            SessionConfig(**clips)
        )
        assert hub.media is not None
        image, clip16 = hub.media.chunk_tokens(1), hub.media.clip_tokens(16)
        # A 16-frame clip is 8 images' tokens; on this 1,024-token engine the clip session's
        # worst case is the whole context, the camera's a bounded window of single images.
        assert clip16 == 8 * image
        assert declared["reservation"]["tokens"] >= clip16 > plain["reservation"]["tokens"] / 4
        assert declared["reservation"]["kv_blocks"] > plain["reservation"]["kv_blocks"]
        # The declared session gets its clips (answered, not refused).
        await answered(clipper, clip_event(16))
        # The undeclared one gets chunk_too_large naming the cap it passed, and goes on.
        await camera.send(clip_event(6))
        err, _ = await recv_until(camera, "error")
        assert err["error"]["code"] == "chunk_too_large", err
        assert "this clip has 6 frames; this session declared at most 1" in err["error"]["message"]
        assert err["error"]["session_survives"]
        await answered(camera, image_event(1))


@pytest.fixture
async def compute_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    # Every chunk costs 150 ms (replies free): a 1 frame/s camera takes 0.15 of the engine's
    # time, so 3 fit under a headroom of 0.5 and a 4th does not (0.60).
    async for s in _serve(
        vlm_engine, None, max_sessions=10, compute_headroom=0.5, chunk_cost_ms=150.0
    ):
        yield s


async def test_compute_admission_refuses_past_the_engine_time(
    compute_server: RunningServer,
) -> None:
    hub = compute_server.hub
    sockets = [
        await websockets.connect(compute_server.url, subprotocols=SUBPROTOCOLS) for _ in range(5)
    ]
    try:
        for ws in sockets[:3]:
            await open_session(ws, **CAMERA)
        await answered(sockets[0], image_event(0))
        frames_before = frames(hub)
        await recv(sockets[3])  # session.created
        await sockets[3].send(json.dumps({"type": "session.open", **CAMERA}))
        err = await recv(sockets[3])
        assert err["type"] == "error" and err["error"]["code"] == "capacity_exceeded", err
        message = err["error"]["message"]
        assert "compute" in message and "the 3 open sessions add 0.45 engine-s/s" in message
        assert "1 frames/s × 150 ms a chunk" in message and "headroom 0.5" in message
        # The refusal ran nothing on the engine: the admitted sessions' frames are theirs.
        assert frames(hub) == frames_before and len(hub.sessions) == 3
        for i, ws in enumerate(sockets[:3]):
            await answered(ws, image_event(i))
        # A slower camera declares its pace and fits: 0.45 + 0.3 × 0.15 = 0.495.
        slow = await open_session(
            sockets[4], **CAMERA, limits={"frames_per_s": 0.3, "max_clip_frames": 1}
        )
        assert slow["config"]["limits"]["frames_per_s"] == 0.3
        await answered(sockets[4], image_event(4))
    finally:
        for ws in sockets:
            await ws.close()


async def test_the_server_measures_chunk_costs_as_it_runs(vlm_engine: object) -> None:
    async for srv in _serve(vlm_engine, None, max_sessions=4, compute_headroom=0.6):
        costs = srv.hub.costs
        # Measured at start-up, before any session: both kinds, each a few chunks.
        assert costs.samples("frame") == costs.samples("text") == CALIBRATION_CHUNKS
        frame = costs.cost("frame")
        assert frame is not None and frame.prefill_ms > 0
        # A calibration taken beside other processes (a busy CI machine) gives way whole to
        # the first chunk measured alone.
        kept = 0 if costs.provisional("frame") else CALIBRATION_CHUNKS
        async with websockets.connect(srv.url, subprotocols=SUBPROTOCOLS) as ws:
            await open_session(ws, retention={"window_chunks": 2}, sampling={"max_tokens": 8})
            measurable = 0
            for seed in range(3):
                done = await answered(ws, image_event(seed))
                measurable += done["usage"]["completion_tokens"] >= 2
            # Every chunk that had the engine to itself and two tokens or more is measured.
            assert costs.samples("frame") == (
                kept + measurable if measurable else CALIBRATION_CHUNKS
            )
