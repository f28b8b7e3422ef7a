"""Socket-level fuzz against the real server: a bounded number of random messages on a few
connections. Next to each connection runs `fuzzcore.SessionModel` (the codec, the state machine
and the pre-engine decode, without I/O), which predicts the answer to every message; the
server must give exactly that answer, with documented events only, never a traceback, and stay
up with every KV block back in the pool.

Sequencing without timing: after each fuzz message the client sends a probe (an unknown event
type with a fresh event_id); the server answers it with `unknown_event_type`, so everything it
sent before that answer is its reply to the fuzz message.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
from collections import Counter
from typing import Any

import httpx
import pytest
import websockets

from tests.realtime.conftest import RunningServer
from tests.reliability import fuzzcore as fc
from tests.reliability.conftest import SUBPROTOCOLS, capture_logs, recv, wait_quiescent
from vllm_realtime_protocol import Limits, State, parse_server_event

pytestmark = pytest.mark.slow

MESSAGES = int(os.environ.get("VLLM_REALTIME_SOCKET_FUZZ_MESSAGES", "160"))
SEED = os.environ.get("VLLM_REALTIME_SOCKET_FUZZ_SEED", "socket-fuzz")


class Connection:
    def __init__(self, ws: Any, limits: Limits) -> None:
        self.ws = ws
        self.model = fc.SessionModel(limits=limits)
        self.probes = 0

    async def send(self, message: str | bytes) -> list[dict[str, Any]]:
        """Send `message`, then a probe; the server's events in between (None: it closed)."""
        await self.ws.send(message)
        self.probes += 1
        probe = f"probe-{self.probes}"
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            await self.ws.send(json.dumps({"type": "probe.ping", "event_id": probe}))
        events: list[dict[str, Any]] = []
        try:
            while True:
                ev = await recv(self.ws, timeout=120)
                parse_server_event(json.dumps(ev))  # a documented server event, every field
                if ev["type"] == "error" and ev["error"]["event_id"] == probe:
                    assert ev["error"]["code"] == "unknown_event_type", ev
                    return events
                events.append(ev)
        except websockets.exceptions.ConnectionClosed:
            events.append({"type": "<closed>", "code": self.ws.close_code})
            return events

    async def until_done(self, events: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
        """`events` plus whatever follows until response.done of `index` (and its error)."""
        while not any(e["type"] == "response.done" for e in events):
            events.append(await self._next())
        done = next(e for e in events if e["type"] == "response.done")
        assert done["frame_index"] == index, events
        if done["status"] == "failed":
            # The error that explains a failed chunk comes right after its response.done.
            while not any(e["type"] == "error" for e in events[events.index(done) + 1 :]):
                events.append(await self._next())
            error = [e for e in events if e["type"] == "error"][-1]["error"]
            while not error["session_survives"] and events[-1]["type"] != "<closed>":
                events.append(await self._next())
        return events

    async def _next(self) -> dict[str, Any]:
        try:
            return await recv(self.ws, timeout=120)
        except websockets.exceptions.ConnectionClosed:
            return {"type": "<closed>", "code": self.ws.close_code}


def _codes(events: list[dict[str, Any]]) -> list[str]:
    return [e["error"]["code"] for e in events if e["type"] == "error"]


def _check(reply: fc.Reply, events: list[dict[str, Any]], conn: Connection) -> None:
    kinds = [e["type"] for e in events]
    codes = _codes(events)
    for code in codes:
        assert code in fc.DOCUMENTED_CODES and code not in fc.SERVER_FAULT_CODES, events
    if reply.kind == "error":
        assert codes[:1] == [reply.code], (reply, events)
        if not reply.survives:
            assert kinds[1:] == ["session.closed", "<closed>"], events
            assert events[-1]["code"] == 1000
        else:
            assert kinds == ["error"], events
    elif reply.kind == "opened":
        assert kinds == ["session.opened"], events
    elif reply.kind == "await_binary":
        assert kinds == [], events
    elif reply.kind == "closed":
        assert kinds == ["session.closed", "<closed>"], events
        assert events[0]["reason"] == "client_closed" and events[-1]["code"] == 1000
    elif reply.kind == "accepted":
        assert kinds[0] == "input.ack" and events[0]["frame_index"] == reply.frame_index, events
        done = next(e for e in events if e["type"] == "response.done")
        if done["status_reason"] == "context_exceeded":
            # The context guard (huge prompts or instructions): documented, fatal.
            assert done["status"] == "failed" and codes == ["context_exceeded"], events
            assert kinds[-2:] == ["session.closed", "<closed>"], events
            conn.model.finish("failed")
            conn.model.proto.server_close("error")
        elif reply.media_error:
            assert done["status"] == "failed" and done["status_reason"] == reply.media_error
            assert codes == [reply.media_error], events
            conn.model.finish("failed")
        else:
            assert done["status"] in ("completed", "incomplete"), events
            assert codes == [], events
            conn.model.finish(done["status"])
    else:
        raise AssertionError(f"unexpected prediction {reply}")


async def test_socket_fuzz(server: RunningServer) -> None:
    rng = random.Random(SEED)
    before = await wait_quiescent(server)
    tried: Counter[str] = Counter()
    connections = 0
    sent = 0
    with capture_logs(level=logging.WARNING) as logs:
        while sent < MESSAGES:
            connections += 1
            async with websockets.connect(
                server.url, subprotocols=SUBPROTOCOLS, max_size=None
            ) as ws:
                hello = await recv(ws)
                conn = Connection(ws, Limits.model_validate(hello["limits"]))
                if rng.random() < 0.85:
                    open_event = json.dumps({"type": "session.open", "sampling": {"max_tokens": 2}})
                    _check(conn.model.feed(open_event), await conn.send(open_event), conn)
                while sent < MESSAGES and conn.model.proto.state is not State.CLOSED:
                    sent += 1
                    binary = conn.model.proto.state is State.AWAITING_BINARY and rng.random() < 0.8
                    if binary or rng.random() < 0.05:
                        name, _, data = fc.gen_media(rng)
                        tried[f"binary:{name}"] += 1
                        reply = conn.model.feed(data, binary=True)
                        events = await conn.send(data)
                    else:
                        cat, message = fc.gen_message(rng, max_huge=1536 << 10, socket_safe=True)
                        tried[cat] += 1
                        reply = conn.model.feed(message)
                        events = await conn.send(message)
                    if reply.kind == "accepted":
                        events = await conn.until_done(events, reply.frame_index or 0)
                    _check(reply, events, conn)
                    if events and events[-1]["type"] == "<closed>":
                        break
        async with httpx.AsyncClient() as client:
            assert (await client.get(server.http + "/health")).status_code == 200
        assert await wait_quiescent(server) == before
    assert not logs.failures(), logs.text()[-4000:]
    print(f"\nsocket fuzz: {sent} messages on {connections} connections: {dict(tried)}")
