"""Resumable sessions against the real server and engine (issue #20): a dropped connection parks
the session, `session.resume` takes it over, the grace period expires it, and the token is a
capability bound to the API key. After each case every KV block is back (`wait_quiescent`)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import websockets

from tests.realtime.conftest import RunningServer, _serve, jpeg_bytes
from tests.reliability.conftest import (
    SUBPROTOCOLS,
    capture_logs,
    drain_until_closed,
    open_session,
    recv,
    recv_until,
    wait_quiescent,
)
from vllm_realtime_protocol import State

pytestmark = pytest.mark.slow

RESUMABLE = {"grace_s": 30}


def image_event(seed: int, **extra: Any) -> str:
    return json.dumps(
        {"type": "frame.append", "image": base64.b64encode(jpeg_bytes(seed)).decode(), **extra}
    )


def resume_event(session_id: str, token: str) -> str:
    return json.dumps(
        {
            "type": "session.resume",
            "event_id": "r1",
            "session_id": session_id,
            "resume_token": token,
        }
    )


@pytest.fixture(scope="module")
async def resume_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    async for s in _serve(
        vlm_engine, "key-a", api_keys=("key-b",), max_sessions=4, max_resume_grace_s=30.0
    ):
        yield s


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def connect(srv: RunningServer, key: str = "key-a") -> Any:
    return await websockets.connect(
        srv.url, subprotocols=SUBPROTOCOLS, additional_headers=headers(key)
    )


def parked_state(srv: RunningServer, session_id: str) -> State | None:
    for conn in srv.app.state.connections:  # type: ignore[attr-defined]
        if conn.proto.session_id == session_id and conn.parked:
            return conn.proto.state  # type: ignore[no-any-return]
    return None


async def wait_parked(
    srv: RunningServer, session_id: str, state: State, timeout: float = 60
) -> None:
    for _ in range(int(timeout / 0.02)):
        if parked_state(srv, session_id) is state:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not {state} after {timeout}s: {parked_state(srv, session_id)}")


async def resume(srv: RunningServer, session_id: str, token: str, key: str = "key-a") -> Any:
    ws = await connect(srv, key)
    assert (await recv(ws))["type"] == "session.created"
    await ws.send(resume_event(session_id, token))
    return ws


@pytest.mark.parametrize("when", ["after_the_reply", "while_it_runs"])
async def test_drop_mid_reply_then_resume(resume_server: RunningServer, when: str) -> None:
    srv = resume_server
    before = await wait_quiescent(srv)
    ws = await connect(srv)
    opened = await open_session(ws, sampling={"max_tokens": 48}, resumable=RESUMABLE)
    sid, token = opened["session_id"], opened["resume_token"]
    assert opened["config"]["resumable"] == {"grace_s": 30.0}
    assert len(base64.urlsafe_b64decode(token + "=")) * 8 >= 128
    await ws.send(image_event(0, frame_id="f0"))
    await recv_until(ws, "response.created")
    ws.transport.abort()  # the network goes away mid-reply
    if when == "after_the_reply":
        # Parked; the reply runs to completion and its response.done is kept.
        await wait_parked(srv, sid, State.PARKED)
        assert sid in srv.hub.sessions, "a parked session keeps its KV and its admission slot"
    ws2 = await resume(srv, sid, token)
    resumed, seen = await recv_until(ws2, "session.resumed")
    assert [e["type"] for e in seen] == ["session.resumed"], seen
    assert resumed["session_id"] == sid and resumed["next_frame_index"] == 1
    assert resumed["resume_token"] != token
    done0: list[dict[str, Any]] = []
    if resumed["missed_response"] is not None:
        assert resumed["in_flight_frame_index"] is None
        done0.append(resumed["missed_response"])
    else:
        assert when == "while_it_runs" and resumed["in_flight_frame_index"] == 0, resumed
        done, _ = await recv_until(ws2, "response.done")
        done0.append(done)
    assert done0[0]["frame_id"] == "f0" and done0[0]["frame_index"] == 0
    assert done0[0]["status"] in ("completed", "incomplete"), done0
    # The session goes on: indices continue, and frame 0's response.done never comes again.
    await ws2.send(image_event(1, frame_id="f1"))
    done1, seen = await recv_until(ws2, "response.done")
    assert done1["frame_index"] == 1 and done1["frame_id"] == "f1"
    assert [e["frame_index"] for e in seen if e["type"] == "response.done"] == [1]
    assert [e["frame_index"] for e in seen if e["type"] == "input.ack"] == [1]
    await ws2.send(json.dumps({"type": "session.close"}))
    rest = await drain_until_closed(ws2)
    assert [e["type"] for e in rest] == ["session.closed"]
    assert rest[0]["frames_total"] == 2
    assert await wait_quiescent(srv) == before


async def test_expiry_frees_the_session_and_a_late_resume_is_not_found(
    resume_server: RunningServer,
) -> None:
    srv = resume_server
    before = await wait_quiescent(srv)
    expired_before = srv.hub.metrics.sessions_expired._value.get()
    with capture_logs() as logs:
        ws = await connect(srv)
        opened = await open_session(ws, resumable={"grace_s": 0.5})
        await ws.send(image_event(2))
        await recv_until(ws, "response.done")
        ws.transport.abort()
        assert await wait_quiescent(srv) == before  # closed after 0.5 s: every block back
    assert "session expired id=" + opened["session_id"][:12] in logs.text()
    assert srv.hub.metrics.sessions_expired._value.get() == expired_before + 1
    async with httpx.AsyncClient() as client:
        metrics = (await client.get(f"{srv.http}/metrics", headers=headers("key-a"))).text
    assert "vllm_realtime_sessions_expired_total" in metrics
    late = await resume(srv, opened["session_id"], opened["resume_token"])
    seen = await drain_until_closed(late)
    assert seen[0]["type"] == "error" and seen[0]["error"]["code"] == "session_not_found"
    assert seen[0]["error"]["event_id"] == "r1" and seen[-1]["type"] == "session.closed"


async def test_wrong_token_or_other_key_is_refused_like_an_unknown_id(
    resume_server: RunningServer,
) -> None:
    srv = resume_server
    before = await wait_quiescent(srv)
    ws = await connect(srv, "key-a")
    opened = await open_session(ws, resumable=RESUMABLE)
    sid, token = opened["session_id"], opened["resume_token"]
    ws.transport.abort()
    await wait_parked(srv, sid, State.PARKED)
    answers = []
    for session_id, tok, key in [
        (sid, token[:-2] + ("AA" if not token.endswith("AA") else "BB"), "key-a"),  # wrong token
        (sid, token, "key-b"),  # right token, another key
        ("sess_" + "0" * 32, token, "key-a"),  # no such session
    ]:
        attempt = await resume(srv, session_id, tok, key)
        seen = await drain_until_closed(attempt)
        assert [e["type"] for e in seen] == ["error", "session.closed"], seen
        answers.append((seen[0]["error"]["code"], seen[0]["error"]["message"]))
    # One answer for all three: nothing tells whether the id exists.
    assert len(set(answers)) == 1 and answers[0][0] == "session_not_found", answers
    # The failed attempts did not hurt the session: its owner still resumes it.
    ws2 = await resume(srv, sid, token, "key-a")
    resumed, _ = await recv_until(ws2, "session.resumed")
    assert resumed["next_frame_index"] == 0 and resumed["missed_response"] is None
    # The token is rotated: the one just used is worthless now.
    stale = await resume(srv, sid, token, "key-a")
    assert (await recv(stale))["error"]["code"] == "session_not_found"
    await stale.close()
    await ws2.send(json.dumps({"type": "session.close"}))
    await drain_until_closed(ws2)
    assert await wait_quiescent(srv) == before


async def test_resume_from_a_second_connection_while_the_first_is_half_open(
    resume_server: RunningServer,
) -> None:
    srv = resume_server
    before = await wait_quiescent(srv)
    first = await connect(srv)
    opened = await open_session(first, sampling={"max_tokens": 4}, resumable=RESUMABLE)
    sid = opened["session_id"]
    await first.send(image_event(3, frame_id="f0"))
    await recv_until(first, "response.done")
    # The first connection goes silent without closing: the server still sees it open.
    first.transport.pause_reading()
    second = await resume(srv, sid, opened["resume_token"])
    resumed, _ = await recv_until(second, "session.resumed")
    assert resumed["next_frame_index"] == 1 and resumed["missed_response"] is None
    await second.send(image_event(4, frame_id="f1"))
    done, _ = await recv_until(second, "response.done")
    assert done["frame_index"] == 1
    # The old socket was let go (code 4000) and never got a session.closed.
    first.transport.resume_reading()
    with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
        while True:
            event = json.loads(await asyncio.wait_for(first.recv(), 30))
            assert event["type"] != "session.closed", event
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4000
    await second.send(json.dumps({"type": "session.close"}))
    seen = await drain_until_closed(second)
    assert seen[-1]["type"] == "session.closed" and seen[-1]["frames_total"] == 2
    assert await wait_quiescent(srv) == before


async def test_resumable_is_off_by_default_and_capped(resume_server: RunningServer) -> None:
    srv = resume_server
    before = await wait_quiescent(srv)
    ws = await connect(srv)
    opened = await open_session(ws)
    assert opened["config"]["resumable"] is None and opened["resume_token"] is None
    assert opened["limits"]["max_resume_grace_s"] == 30.0
    ws.transport.abort()  # fail-closed stays the default: the session ends at once
    assert await wait_quiescent(srv) == before
    ws = await connect(srv)
    opened = await open_session(ws, resumable={"grace_s": 3600})
    assert opened["config"]["resumable"] == {"grace_s": 30.0}
    # A clean WebSocket close without session.close is a drop like any other: parked.
    await ws.close()
    await wait_parked(srv, opened["session_id"], State.PARKED)
    resumed = await resume(srv, opened["session_id"], opened["resume_token"])
    await recv_until(resumed, "session.resumed")
    await resumed.send(json.dumps({"type": "session.close"}))
    await drain_until_closed(resumed)
    assert await wait_quiescent(srv) == before


async def test_drain_closes_parked_sessions(vlm_engine: object) -> None:
    async for srv in _serve(vlm_engine, None, max_sessions=4, max_resume_grace_s=30.0):
        before = await wait_quiescent(srv)
        ws = await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS)
        opened = await open_session(ws, resumable=RESUMABLE)
        ws.transport.abort()
        await wait_parked(srv, opened["session_id"], State.PARKED)
        # The drain does not wait out the grace period: a parked session closes like an idle one.
        await asyncio.wait_for(srv.app.state.drain(), 30)  # type: ignore[attr-defined]
        assert await wait_quiescent(srv) == before
