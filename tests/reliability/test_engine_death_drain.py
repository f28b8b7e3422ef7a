"""A dead engine is drained as a shutdown is, with no time left (realtime/drain.py,
`drain_dead_engine`), on real `Connection`s over a fake socket and hub (no engine): what each
kind of session is told, and what admission says afterwards. The same path with real processes
(an EngineCore SIGKILLed under two replicas and Redis) is tests/scale_out/test_engine_death.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.websockets import WebSocketState

from realtime.config import ServerConfig
from realtime.connection import Connection
from realtime.drain import Lifecycle, drain_dead_engine
from realtime.metrics import Metrics
from vllm_realtime_protocol import CapacityExceeded, EngineError, Limits, SessionProtocol


class FakeSocket:
    """What Connection sends and closes; it never receives here."""

    def __init__(self) -> None:
        self.client_state = WebSocketState.CONNECTED
        self.sent: list[dict[str, Any]] = []
        self.stuck = False  # a client that never reads: every send waits for good

    async def send_text(self, text: str) -> None:
        if self.stuck:
            await asyncio.Event().wait()
        self.sent.append(json.loads(text))

    async def close(self, code: int = 1000) -> None:
        self.client_state = WebSocketState.DISCONNECTED


def fake_hub() -> Any:
    async def close_session(record: object) -> None:
        return None

    config = ServerConfig()
    return SimpleNamespace(
        config=config,
        metrics=Metrics(),
        store=None,
        new_protocol=lambda: SessionProtocol(Limits(server_version="test", model="fake")),
        close_session=close_session,
    )


def connection(
    lifecycle: Lifecycle, live: set[Connection], *, fence: int | None, store_ok: bool = True
) -> tuple[Connection, FakeSocket]:
    ws = FakeSocket()
    conn = Connection(ws, fake_hub(), None, lifecycle, None, live)  # type: ignore[arg-type]
    conn.session.fence, conn.session.store_ok = fence, store_ok
    live.add(conn)
    return conn, ws


def kinds(ws: FakeSocket) -> list[tuple[str, Any]]:
    """Each event's type with what tells it apart (handover, error code, close reason)."""
    out: list[tuple[str, Any]] = []
    for e in ws.sent:
        detail = {
            "server.draining": lambda e: (e["handover"], e["seconds_left"]),
            "error": lambda e: e["error"]["code"],
            "session.closed": lambda e: e["reason"],
        }.get(e["type"], lambda e: None)(e)
        out.append((e["type"], detail))
    return out


async def test_stored_sessions_are_handed_over_and_the_others_get_engine_error() -> None:
    lifecycle = Lifecycle(drain_timeout_s=30)
    live: set[Connection] = set()
    stored, stored_ws = connection(lifecycle, live, fence=1)
    behind, behind_ws = connection(lifecycle, live, fence=1, store_ok=False)  # a write failed
    unstored, unstored_ws = connection(lifecycle, live, fence=None)
    closed_http: list[object] = []

    async def close_http(record: object) -> None:
        closed_http.append(record)

    http = {"sess_1": SimpleNamespace(lock=asyncio.Lock())}
    await drain_dead_engine(lifecycle, live, http, close_http, "EngineDeadError")

    assert kinds(stored_ws) == [
        ("server.draining", (True, 0.0)),
        ("session.closed", "server_shutdown"),
    ]
    for ws in (behind_ws, unstored_ws):
        assert kinds(ws) == [("error", "engine_error"), ("session.closed", "engine_error")]
    assert all(c.closed for c in (stored, behind, unstored)) and not live
    assert len(closed_http) == 1  # the HTTP session too
    assert stored.session.lost_engine and not behind.session.lost_engine
    # Admission: engine_error now, not "shutting down" (the server may be kept up).
    assert lifecycle.draining and lifecycle.seconds_left() == 0.0
    with pytest.raises(EngineError):
        lifecycle.check_admitting("evt")


async def test_a_drain_under_way_is_cut_short_by_the_engine_death() -> None:
    """SIGTERM first (server.draining with the drain's time left), then the engine dies: the
    stored session is closed now, its record kept; it is not told server.draining twice."""
    lifecycle = Lifecycle(drain_timeout_s=30)
    live: set[Connection] = set()
    conn, ws = connection(lifecycle, live, fence=1)
    lifecycle.start_drain()
    with pytest.raises(CapacityExceeded):
        lifecycle.check_admitting()
    conn.session.turn = asyncio.create_task(asyncio.sleep(60))  # a reply in flight holds the close
    await conn.begin_drain(lifecycle.seconds_left())
    assert [k for k, _ in kinds(ws)] == ["server.draining"] and not conn.closed
    await drain_dead_engine(lifecycle, live, {}, close_http=_nothing, why="EngineDeadError")
    assert [k for k, _ in kinds(ws)] == ["server.draining", "session.closed"]
    assert ws.sent[-1]["reason"] == "server_shutdown" and conn.session.lost_engine


async def _nothing(record: object) -> None:
    return None


async def test_a_socket_that_takes_nothing_does_not_hold_the_exit_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server's side (realtime/server.py): the exit's timer is armed when the engine is
    found dead, and the server is stopped after at most ENGINE_DEAD_DRAIN_S of drain, even
    when a client's socket takes nothing."""
    import realtime.server as server

    monkeypatch.setattr(server, "ENGINE_DEAD_DRAIN_S", 0.3)
    shared = server._App(ServerConfig())
    calls: list[str] = []
    shared.exit_on_engine_death = server.EngineDeathExit(
        arm=lambda: calls.append("arm"), stop=lambda: calls.append("stop")
    )
    _, stuck = connection(shared.lifecycle, shared.connections, fence=1)  # type: ignore[arg-type]
    stuck.stuck = True
    hub = fake_hub()
    hub.of_transport = lambda transport: {}
    hub.engine_failure = "EngineDeadError"
    started = time.monotonic()
    await server._engine_died(hub, shared)
    assert calls == ["arm", "stop"] and time.monotonic() - started < 3
    await server._engine_died(hub, shared)  # the next watchdog round: armed and stopped once
    assert calls == ["arm", "stop"]
