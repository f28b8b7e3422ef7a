"""Capacity on the shared tiny-VLM engine (16 request slots) behind a server allowing 40 sessions.

A paused streaming session keeps its engine request slot. Before the fix in realtime/hub.py
(SessionHub.open_session) the server admitted a 17th session whose first chunk then waited,
unanswered, until one of the other sessions closed: a deadlock for a client that waits.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import websockets

from tests.realtime.conftest import RunningServer, image_event
from tests.reliability.conftest import (
    SUBPROTOCOLS,
    drain_until_closed,
    recv,
    recv_until,
    wait_quiescent,
)

pytestmark = pytest.mark.slow


async def test_sessions_beyond_the_engine_slots_are_refused(slots_server: RunningServer) -> None:
    srv = slots_server
    hub = srv.hub
    slots = hub.engine_slots
    assert slots is not None and slots < hub.config.max_sessions
    before = await wait_quiescent(srv)
    sockets: list[Any] = []
    try:
        for _ in range(slots):
            ws = await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS)
            sockets.append(ws)
            await recv(ws)
            await ws.send(json.dumps({"type": "session.open", "sampling": {"max_tokens": 2}}))
            assert (await recv(ws))["type"] == "session.opened"

        async def one_frame(ws: Any, i: int) -> None:
            await ws.send(image_event(i, frame_id=f"s{i}"))
            done, _ = await recv_until(ws, "response.done", timeout=300)
            assert done["frame_id"] == f"s{i}" and done["status"] != "failed"

        # All slots now hold a paused session; each still gets its replies.
        for _ in range(2):
            await asyncio.wait_for(
                asyncio.gather(*(one_frame(ws, i) for i, ws in enumerate(sockets))), 600
            )
        extra = await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS)
        sockets.append(extra)
        await recv(extra)
        await extra.send(json.dumps({"type": "session.open", "event_id": "17th"}))
        err = await recv(extra)
        assert err["error"]["code"] == "capacity_exceeded", err
        assert "max_num_seqs" in err["error"]["message"] and err["error"]["event_id"] == "17th"
        async with httpx.AsyncClient(base_url=srv.http, timeout=60) as client:
            r = await client.post("/v1/streaming/sessions", json={})
            assert r.status_code == 429 and r.json()["error"]["code"] == "capacity_exceeded"
        # One closes: the refused connection gets in, and its frame is answered.
        await sockets[0].send(json.dumps({"type": "session.close"}))
        await drain_until_closed(sockets[0])
        for _ in range(200):
            if len(hub.sessions) < slots:
                break
            await asyncio.sleep(0.05)
        await extra.send(json.dumps({"type": "session.open", "sampling": {"max_tokens": 2}}))
        assert (await recv(extra))["type"] == "session.opened"
        await asyncio.wait_for(one_frame(extra, 99), 300)
    finally:
        for ws in sockets:
            await ws.close()
    assert await wait_quiescent(srv) == before
