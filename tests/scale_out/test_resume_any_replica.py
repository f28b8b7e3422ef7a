"""Resume on any replica (issue #39): two real `vllm-realtime serve` replicas of SmolLM2-135M
on loopback ports share one real redis-server.

* Security: another API key, a replayed token, an expired session and a lost lease all get the
  same `session_not_found`; the store keeps nothing of a session that closed or expired.
* A resume racing a half-open old connection: the other replica claims the session and rebuilds
  it; the old owner sees the fence move on and lets go (its old socket gets
  `session_not_found`, and it writes nothing more).
* A parked owner (alive) lets the session go when another replica resumes it.
* A drain (SIGTERM) hands a stored session over: `server.draining` says `handover`, and the
  session resumes on a restarted replica (one step of a rolling restart).
* The replica holding a session is SIGKILLed (its whole process group: server, EngineCore,
  worker). The session resumes on the other, rebuilt with one re-prefill, and its first reply
  equals token for token (greedy) the reply of the same session run on one replica; a fact told
  before the kill is recalled after it.

Oracle of the last point: the window (6 chunks) holds every chunk, so nothing was evicted and
the session on one replica holds the same tokens at positions 0..n-1 that the rebuild
re-prefills: it IS the session consolidated (a re-prefill recomputes exactly those). The
engine-level oracle with evictions and a real consolidation is tests/retention/test_restore.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from tests.scale_out.conftest import (
    FACT,
    OPEN,
    QUESTION,
    REPLICA_ARGS,
    Replica,
    close,
    connect,
    events_until_closed,
    not_found,
    open_session,
    recv_type,
    replica_pair,
    resume,
    say,
    sessions_on,
    start_replica,
    wait_healthy,
)

pytestmark = pytest.mark.slow

FILLER = ["The weather is sunny today.", "I had pasta for lunch."]


@pytest.fixture(scope="module")
def pair(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    with replica_pair(
        redis_url, tmp_path_factory.mktemp("replicas"), ("replica-a", "replica-b")
    ) as reps:
        yield reps


async def test_refusals_and_a_resume_racing_a_half_open_connection(
    pair: list[Replica], redis_client: Any
) -> None:
    a, b = pair
    old, sid, token = await open_session(a)
    await say(old, FACT)
    # Another API key, a wrong token: the same answer as an unknown id.
    ws, event = await resume(b, sid, token, key="key-b")
    assert not_found(event), event
    await ws.close()
    ws, event = await resume(b, sid, token + "x")
    assert not_found(event), event
    await ws.close()
    # `old` still looks open to replica A (half-open): the resume on B takes the session.
    new, resumed = await resume(b, sid, token)
    assert resumed["type"] == "session.resumed", resumed
    assert resumed["rebuilt"] is True and resumed["reprefilled_tokens"] > 0
    assert resumed["next_frame_index"] == 1
    # A lost its lease: the old socket gets session_not_found (at the latest when it sends a
    # chunk; A's keeper usually sees the fence move within a second) and is closed.
    with contextlib.suppress(websockets.ConnectionClosed):
        await old.send(json.dumps({"type": "frame.append", "text": FILLER[0]}))
    seen = await events_until_closed(old)
    assert any(not_found(e) for e in seen), seen
    assert not any(e["type"] == "response.done" and e["status"] == "completed" for e in seen)
    # The replayed token is worthless; the session goes on on B.
    ws, event = await resume(a, sid, token)
    assert not_found(event), event
    await ws.close()
    done = await say(new, QUESTION)
    assert done["frame_index"] == 1
    # Closed: nothing of it stays in the store.
    await close(new)
    assert await redis_client.keys("vrt:session:*") == []


async def test_an_expired_session_is_gone_everywhere(
    pair: list[Replica], redis_client: Any
) -> None:
    a, b = pair
    ws, sid, token = await open_session(a, resumable={"grace_s": 1.0})
    await say(ws, FACT)
    await ws.close()  # parked on A for 1 s, then expired there
    await asyncio.sleep(2.5)
    assert await redis_client.keys("vrt:session:*") == []
    for replica in (a, b):
        again, event = await resume(replica, sid, token)
        assert not_found(event), event
        await again.close()


async def test_a_parked_owner_lets_go(pair: list[Replica], redis_client: Any) -> None:
    a, b = pair
    ws, sid, token = await open_session(a)
    await say(ws, FACT)
    await ws.close()  # parked on A (alive, holding the KV) for its grace period
    assert sessions_on(a) == 1
    new, resumed = await resume(b, sid, token)
    assert resumed["type"] == "session.resumed" and resumed["rebuilt"] is True, resumed
    # A sees the fence move on (its keeper, within about a second) and frees the session.
    for _ in range(100):
        if sessions_on(a) == 0:
            break
        await asyncio.sleep(0.1)
    assert sessions_on(a) == 0
    assert "Biscuit" in (await say(new, QUESTION))["text"]
    await close(new)
    assert await redis_client.keys("vrt:session:*") == []


async def test_the_owner_is_killed_and_the_session_goes_on_elsewhere(
    pair: list[Replica], redis_client: Any
) -> None:
    a, b = pair
    # The same session on one replica, start to end: the reference reply.
    ref, _, _ = await open_session(b)
    for text in (FACT, *FILLER):
        await say(ref, text)
    reference = await say(ref, QUESTION)
    await close(ref)
    # The session on A; A dies (SIGKILL, no goodbye) with the client attached.
    ws, sid, token = await open_session(a)
    for text in (FACT, *FILLER):
        await say(ws, text)
    stored = await redis_client.hget(f"vrt:session:{sid}", "state")
    print(f"bytes per fold: {len(stored.encode())}")
    a.kill()
    with contextlib.suppress(Exception):
        await ws.close()
    started = time.perf_counter()
    new, resumed = await resume(b, sid, token)
    took = time.perf_counter() - started
    assert resumed["type"] == "session.resumed", resumed
    # Every fold is written before its response.done: the rebuild is at the last reply.
    assert resumed["rebuilt"] is True and resumed["next_frame_index"] == 3, resumed
    print(f"resume with rebuild: {took:.3f} s, {resumed['reprefilled_tokens']} tokens")
    after = await say(new, QUESTION)
    assert after["text"] == reference["text"]  # greedy: the same tokens
    assert after["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
    assert "Biscuit" in after["text"], after["text"]
    await close(new)
    assert await redis_client.keys("vrt:session:*") == []


async def test_a_drain_hands_the_session_over(
    pair: list[Replica], redis_url: str, redis_client: Any, tmp_path: Path
) -> None:
    """A rolling restart's step: A (killed above) is started again, then B drains (SIGTERM)
    with a stored session attached; the client is told to resume elsewhere and does."""
    b = pair[1]
    # A2's compute admits one session only (a pinned 1 s chunk at 1 frame/s, over the 0.5
    # headroom beside any other): a hand-over is still taken, since the fleet admitted it.
    a2 = start_replica(
        redis_url, tmp_path, "replica-a2", [*REPLICA_ARGS, "--chunk-cost-ms", "1000"]
    )
    pair[0] = a2  # the fixture stops it
    wait_healthy(a2)
    local, _, _ = await open_session(a2)
    second = await connect(a2)
    await second.send(json.dumps(OPEN))
    refused = await recv_type(second, "session.opened", "error")
    assert refused["type"] == "error", refused
    assert refused["error"]["code"] == "capacity_exceeded", refused
    assert "compute" in refused["error"]["message"], refused
    await second.close()
    ws, sid, token = await open_session(b)
    await say(ws, FACT)
    b.proc.send_signal(signal.SIGTERM)
    seen = await events_until_closed(ws)
    draining = [e for e in seen if e["type"] == "server.draining"]
    assert draining and draining[0]["handover"] is True, seen
    assert seen[-1]["type"] == "session.closed" and seen[-1]["reason"] == "server_shutdown"
    assert b.proc.wait(timeout=120) == 0  # drained and stopped cleanly
    new, resumed = await resume(a2, sid, token)
    assert resumed["type"] == "session.resumed" and resumed["rebuilt"] is True, resumed
    assert "Biscuit" in (await say(new, QUESTION))["text"]
    await close(new)
    await close(local)
    assert await redis_client.keys("vrt:session:*") == []
