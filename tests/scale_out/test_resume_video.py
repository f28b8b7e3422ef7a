"""Video sessions outlive their replica (issue #39): two real `vllm-realtime serve` replicas of
the default model (`smol-qwen2-vl`) on loopback share one real redis-server.

* The owner of a video session is SIGKILLed; the session resumes on the other replica, rebuilt
  from its stored record (snapshot + the retained frames' JPEG bytes), and its first reply
  equals token for token (greedy) the reply of the same session run on one replica. The
  session has the default retention of a camera session (1 sink chunk, 8 window chunks) and
  640x480 JPEG frames; the test prints what its record costs (per fold, and in all).
  Oracle, as for text (test_resume_any_replica.py): the window holds every chunk, so the session
  on one replica holds the same tokens at the same positions that the rebuild re-prefills (it
  IS the session consolidated). The engine-level oracle with evictions, remnants and a real
  consolidation is tests/retention/test_restore_video.py.
* A parked owner lets the session go, after evictions: the store keeps the frames of the sink
  and window chunks only, and the rebuild elsewhere answers.
* A resume racing a half-open old connection: the old socket gets `session_not_found`.
* The store is down at the resume: `capacity_exceeded` (retryable), never `internal_error`.
  (Last in this module: it stops this module's redis-server.)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from tests.realtime.conftest import camera_jpeg
from tests.scale_out.conftest import (
    OPEN_VIDEO,
    VIDEO_ARGS,
    Replica,
    close,
    events_until_closed,
    not_found,
    open_session,
    replica_pair,
    resume,
    sessions_on,
    show,
    start_replica,
    wait_healthy,
)

pytestmark = pytest.mark.slow

NARROW = {"sink_chunks": 1, "window_chunks": 2}


@pytest.fixture(scope="module")
def pair(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    logdir = tmp_path_factory.mktemp("replicas")
    with replica_pair(redis_url, logdir, ("video-a", "video-b"), VIDEO_ARGS) as reps:
        yield reps


async def open_video(replica: Replica, **extra: Any) -> tuple[Any, str, str]:
    return await open_session(replica, OPEN_VIDEO, **extra)


async def record_of(client: Any, sid: str) -> dict[str, str]:
    fields: dict[str, str] = await client.hgetall(f"vrt:session:{sid}")
    return fields


def frame_fields(record: dict[str, str]) -> list[int]:
    return sorted(int(k.split(":", 1)[1]) for k in record if k.startswith("frame:"))


async def test_the_owner_is_killed_and_the_video_session_goes_on_elsewhere(
    pair: list[Replica], redis_client: Any
) -> None:
    a, b = pair
    # The same session on one replica, start to end: the reference reply.
    ref, _, _ = await open_video(b)
    for i in range(5):
        await show(ref, i)
    reference = await show(ref, 5, "What colour is it?")
    await close(ref)
    ws, sid, token = await open_video(a)
    for i in range(5):
        await show(ws, i)
        record = await record_of(redis_client, sid)
        state = len(record["state"])
        frame = len(record.get(f"frame:{i}", ""))
        print(f"fold {i}: state {state} B + new frame {frame} B (base64) written")
    record = await record_of(redis_client, sid)
    assert frame_fields(record) == [0, 1, 2, 3, 4]  # 1 sink + 8 window chunks hold all five
    total = sum(len(k) + len(v) for k, v in record.items())
    print(f"record after 5 frames: {total} B in {len(record)} fields")
    a.kill()
    with contextlib.suppress(Exception):
        await ws.close()
    started = time.perf_counter()
    new, resumed = await resume(b, sid, token)
    took = time.perf_counter() - started
    assert resumed["type"] == "session.resumed", resumed
    assert resumed["rebuilt"] is True and resumed["next_frame_index"] == 5, resumed
    print(f"video resume with rebuild: {took:.3f} s, {resumed['reprefilled_tokens']} tokens")
    after = await show(new, 5, "What colour is it?")
    print(f"reply after the rebuild: {after['text']!r}; on one replica: {reference['text']!r}")
    assert after["text"] == reference["text"]  # greedy: the same tokens
    assert after["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
    await close(new)
    assert await redis_client.keys("vrt:session:*") == []


async def test_a_parked_owner_lets_a_video_session_go(
    pair: list[Replica], redis_client: Any, redis_url: str, tmp_path: Path
) -> None:
    """After evictions: only the sink's and the window's frames are in the store."""
    if pair[0].proc.poll() is not None:  # killed by the test above: start it again
        pair[0] = start_replica(redis_url, tmp_path, "video-a2", VIDEO_ARGS)
        wait_healthy(pair[0])
    a, b = pair
    ws, sid, token = await open_video(a, retention=NARROW)
    for i in range(7):
        await show(ws, i)
    kept = frame_fields(await record_of(redis_client, sid))
    print(f"frames stored after 7 frames (sink 1, window 2): {kept}")
    assert 0 in kept and len(kept) <= 3 and 6 in kept  # evicted chunks' frames were deleted
    await ws.close()  # parked on A (alive, holding the KV) for its grace period
    new, resumed = await resume(b, sid, token)
    assert resumed["type"] == "session.resumed" and resumed["rebuilt"] is True, resumed
    for _ in range(100):
        if sessions_on(a) == 0:
            break
        await asyncio.sleep(0.1)
    assert sessions_on(a) == 0
    await show(new, 7)
    await close(new)
    assert await redis_client.keys("vrt:session:*") == []


async def test_a_video_resume_racing_a_half_open_connection(
    pair: list[Replica], redis_client: Any
) -> None:
    a, b = pair
    old, sid, token = await open_video(a)
    await show(old, 0)
    # `old` still looks open to A (half-open): the resume on B takes the session.
    new, resumed = await resume(b, sid, token)
    assert resumed["type"] == "session.resumed" and resumed["rebuilt"] is True, resumed
    with contextlib.suppress(websockets.ConnectionClosed):
        image = base64.b64encode(camera_jpeg(1)).decode()
        await old.send(json.dumps({"type": "frame.append", "image": image}))
    seen = await events_until_closed(old)
    assert any(not_found(e) for e in seen), seen
    assert not any(e["type"] == "response.done" and e["status"] == "completed" for e in seen)
    assert (await show(new, 1))["frame_index"] == 1
    await close(new)
    assert await redis_client.keys("vrt:session:*") == []


async def test_the_store_down_at_a_resume_is_retryable(
    pair: list[Replica], redis_server: tuple[Any, str]
) -> None:
    a, b = pair
    ws, sid, token = await open_video(a)
    await show(ws, 0)
    await ws.close()  # parked on A
    proc, _ = redis_server
    proc.terminate()
    proc.wait(timeout=10)
    for replica in (b, a):  # another replica, and the owner itself (the store is the authority)
        again, event = await resume(replica, sid, token)
        assert event["type"] == "error", event
        assert event["error"]["code"] == "capacity_exceeded", event  # retry later
        assert "session store" in event["error"]["message"]
        # The connection stays usable (not fatal): it still answers, and is closed by us.
        assert again.state == websockets.protocol.State.OPEN
        await again.close()
