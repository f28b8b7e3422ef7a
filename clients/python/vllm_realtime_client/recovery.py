"""Recovery of a resilient session: a new connection, then a resume or a new session.

When a resilient session's socket drops, :func:`recover` reconnects and sends
``session.resume`` through a fresh :class:`~vllm_realtime_protocol.client.ClientProtocol`
(CONNECTED → CONNECTED); ``session.resumed`` puts that machine in IDLE, or AWAITING_RESPONSE when
the reply in flight still runs, with the server's ``next_frame_index`` and the new resume token.
After a drain (or a refused resume) it opens a new session with the same settings, on a new
machine the same way.  :func:`adopt` then carries the session on: it finishes the reply in flight
from ``session.resumed``, or sends the chunk the server never got (or lost with its server) again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from vllm_realtime_client.errors import ConnectError, ConnectionLost, RealtimeError, Unauthorized
from vllm_realtime_protocol.client import ClientProtocol
from vllm_realtime_protocol.codec import encode_client_event, parse_server_event
from vllm_realtime_protocol.errors import InternalError
from vllm_realtime_protocol.events import (
    ErrorEvent,
    SessionClosedEvent,
    SessionConfig,
    SessionCreatedEvent,
    SessionOpenedEvent,
    SessionOpenEvent,
    SessionResumedEvent,
    SessionResumeEvent,
)

if TYPE_CHECKING:
    from vllm_realtime_client.session import RealtimeSession

__all__ = ["adopt", "exchange", "recover", "reopen_event", "resume_event"]

log = logging.getLogger("vllm_realtime_client")


async def recover(session: RealtimeSession, *, fresh: bool) -> bool:
    """Reconnect: resume the session, or (``fresh``, or the resume refused) open a new one with
    the same settings. At most ``max_retries`` connection attempts, with backoff."""
    connector = session._connector
    assert connector is not None and session._proto.config is not None
    session._ready.clear()
    delay = connector.retry_backoff
    for attempt in range(connector.max_retries):
        if attempt:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 8.0)
        if session._user_closing:
            return False
        try:
            ws, greeting = await connector._handshake()
        except Unauthorized:
            return False  # the key (or secret) is no longer good: retrying will not help
        except (ConnectError, RealtimeError) as exc:
            log.info("reconnect attempt %d failed: %s", attempt + 1, exc)
            continue
        proto = ClientProtocol()
        proto.receive(greeting)
        try:
            if not fresh:
                resumed = await exchange(session, ws, proto, resume_event(session))
                if isinstance(resumed, SessionResumedEvent):
                    await adopt(session, ws, proto, greeting, resumed)
                    return True
                log.info("session.resume refused (%s): opening a new session", resumed)
                fresh = True
                with contextlib.suppress(Exception):
                    await ws.close()
                delay = connector.retry_backoff
                continue  # the refusal ended that connection; open on a new one
            opened = await exchange(session, ws, proto, reopen_event(session))
            if isinstance(opened, SessionOpenedEvent):
                await adopt(session, ws, proto, greeting, opened)
                return True
            log.info("reopening refused (%s); retrying", opened)
        except (ConnectionClosed, asyncio.TimeoutError, OSError) as exc:
            log.info("reconnect attempt %d broke: %r", attempt + 1, exc)
        with contextlib.suppress(Exception):
            await ws.close()
    return False


def resume_event(session: RealtimeSession) -> SessionResumeEvent:
    """The ``session.resume`` of the session as its machine knows it."""
    token = session._proto.resume_token
    assert token is not None
    return SessionResumeEvent(
        event_id=session._new_id(), session_id=session.session_id, resume_token=token
    )


def reopen_event(session: RealtimeSession) -> SessionOpenEvent:
    """A ``session.open`` with the settings the server last confirmed."""
    config = session._proto.config
    assert config is not None
    fields = {name: getattr(config, name) for name in SessionConfig.model_fields}
    return SessionOpenEvent(event_id=session._new_id(), **fields)


async def exchange(
    session: RealtimeSession,
    ws: ClientConnection,
    proto: ClientProtocol,
    event: SessionResumeEvent | SessionOpenEvent,
) -> SessionResumedEvent | SessionOpenedEvent | str:
    """Send one event through ``proto`` on a fresh socket and read up to its answer (each
    through ``proto`` too): the answer, or the code of the error that refused it."""
    await ws.send(encode_client_event(proto.send(event)))
    assert session._connector is not None
    want = SessionResumedEvent if isinstance(event, SessionResumeEvent) else SessionOpenedEvent
    while True:
        raw = await asyncio.wait_for(ws.recv(), session._connector.open_timeout)
        if isinstance(raw, bytes):
            continue
        answer = parse_server_event(raw)
        try:
            proto.receive(answer)
        except InternalError as exc:  # the server broke the protocol's order: its bug
            log.error("server event out of order while reconnecting: %s", exc)
        if isinstance(answer, want):
            return answer
        if isinstance(answer, ErrorEvent):
            return answer.error.code
        if isinstance(answer, SessionClosedEvent):  # e.g. the server drains
            return f"session.closed ({answer.reason})"


async def adopt(
    session: RealtimeSession,
    ws: ClientConnection,
    proto: ClientProtocol,
    greeting: SessionCreatedEvent,
    answer: SessionResumedEvent | SessionOpenedEvent,
) -> None:
    """Carry on with the session on ``ws`` and its machine ``proto``; finish or resend the
    chunk in flight."""
    s = session
    turn = s._turn
    pending = turn is not None and not turn.finished.is_set()
    # The index the chunk in flight has (or gets), by the old machine.
    expected = (
        s._proto.next_frame_index if turn is None or turn.ack is None else turn.ack.frame_index
    )
    old, s._ws, s._proto = s._ws, ws, proto
    with contextlib.suppress(Exception):
        await asyncio.wait_for(old.close(), 1.0)
    s._created = greeting
    s._moving = False
    s.draining = None
    if isinstance(answer, SessionResumedEvent):
        s.resumes += 1
        s._opened = SessionOpenedEvent(
            session_id=answer.session_id,
            config=answer.config,
            limits=answer.limits,
            resume_token=answer.resume_token,
        )
        s._emit(answer)
        s._call_hook(s._on_resumed, answer)
        if pending:
            assert turn is not None
            missed = answer.missed_response
            if missed is not None and missed.frame_index == expected:
                s._ack(turn, expected)
                turn.finish(missed)
            elif answer.in_flight_frame_index == expected:
                s._ack(turn, expected)  # the rest of the reply comes on this socket
            elif turn.ack is None:
                await s._resend(turn)
            elif answer.next_frame_index == expected and not turn.resent:
                # Accepted, then lost with its server (the store is at the last
                # response.done): the resumed session expects this chunk again. Once: a
                # chunk that kills servers must not kill the fleet.
                turn.resent = True
                s.chunks_resent += 1
                log.warning(
                    "the reply to chunk %d was lost with its server; sending the chunk "
                    "again to the resumed session",
                    expected,
                )
                await s._resend(turn)
            else:
                turn.fail(ConnectionLost("the reply in flight was lost with its server"))
    else:
        s.generation += 1
        s._opened = answer
        s._emit(answer)
        if s._on_reopened is None:
            # Never silent: the context the old session held is gone.
            log.warning(
                "session could not be resumed: new session %s (generation %d) replaced it; "
                "its context is lost (pass on_reopened= to handle this)",
                answer.session_id[:12],
                s.generation,
            )
        s._call_hook(s._on_reopened, answer)
        if pending:
            assert turn is not None
            if turn.ack is None:
                await s._resend(turn)  # never accepted: it goes to the new session
            else:
                turn.fail(ConnectionLost("the reply in flight was lost with the session"))
    s._ready.set()
    log.info(
        "session %s on a new connection (%s)",
        s.session_id[:12],
        "resumed" if isinstance(answer, SessionResumedEvent) else "new session",
    )
