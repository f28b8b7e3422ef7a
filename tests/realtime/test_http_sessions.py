"""HTTP sessions are `Session`s (realtime/session.py), kept by `HttpSessions` beside the hub's
registry, which says which are open (no engine: a stand-in hub)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from realtime.http_api import HttpSessions
from realtime.session import Session
from vllm_realtime_protocol import Limits, SessionNotFound, SessionProtocol

LIMITS = Limits(server_version="0", model="m")


class StandInHub:
    """The hub's registry as HttpSessions and Session use it."""

    def __init__(self) -> None:
        self.sessions: dict[str, Any] = {}
        self.closed: list[Any] = []
        self.store = None

    def new_protocol(self) -> SessionProtocol:
        return SessionProtocol(LIMITS)

    def find(self, session_id: str, owner: str | None, transport: str) -> Any:
        record = self.sessions.get(session_id)
        if record is None or record.transport != transport or owner != record.owner:
            raise SessionNotFound("no such session")
        return record

    async def close_session(self, record: Any) -> None:
        self.sessions.pop(record.session_id, None)
        self.closed.append(record)


def open_session(hub: StandInHub, sessions: HttpSessions, key: str | None = None) -> Session:
    session = Session(hub, key)  # type: ignore[arg-type]
    record = SimpleNamespace(session_id=session.session_id, transport="http", owner=key)
    session.record = record  # type: ignore[assignment]
    hub.sessions[session.session_id] = record
    sessions.add(session)
    return session


async def test_an_http_session_is_a_session_found_by_id_and_closed_once() -> None:
    hub, sessions = StandInHub(), HttpSessions()
    session = open_session(hub, sessions)
    assert sessions.find(hub, session.session_id, None) is session  # type: ignore[arg-type]
    await sessions.close(session)
    assert session.closed and hub.closed == [session.record]
    with pytest.raises(SessionNotFound):
        sessions.find(hub, session.session_id, None)  # type: ignore[arg-type]


async def test_sessions_the_hub_closed_are_forgotten() -> None:
    """The idle reaper and the drain close HTTP sessions through the hub: the next open drops
    them here, and a lookup answers session_not_found."""
    hub, sessions = StandInHub(), HttpSessions()
    first = open_session(hub, sessions)
    await hub.close_session(first.record)
    with pytest.raises(SessionNotFound):
        sessions.find(hub, first.session_id, None)  # type: ignore[arg-type]
    idle = open_session(hub, sessions)
    await hub.close_session(idle.record)
    kept = open_session(hub, sessions)
    assert kept.session_id in sessions
    assert first.session_id not in sessions and idle.session_id not in sessions
    # A record that is not this session's (another session under the same id) is not it.
    hub.sessions[kept.session_id] = SimpleNamespace(
        session_id=kept.session_id, transport="http", owner=None
    )
    with pytest.raises(SessionNotFound):
        sessions.find(hub, kept.session_id, None)  # type: ignore[arg-type]


async def test_another_keys_lookup_leaves_the_session_alone() -> None:
    """Another key gets session_not_found, and the owner still finds the session after it."""
    hub, sessions = StandInHub(), HttpSessions()
    session = open_session(hub, sessions, key="key-a")
    with pytest.raises(SessionNotFound):
        sessions.find(hub, session.session_id, "key-b")  # type: ignore[arg-type]
    assert sessions.find(hub, session.session_id, "key-a") is session  # type: ignore[arg-type]
