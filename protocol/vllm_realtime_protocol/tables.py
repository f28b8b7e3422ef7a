"""The session's transition tables: plain data that both sides' machines read.

The server's :class:`~vllm_realtime_protocol.state.SessionProtocol` and the client's
:class:`~vllm_realtime_protocol.client.ClientProtocol` step through the same
:data:`TRANSITIONS` and refuse the same pairs with the same errors (:data:`REFUSALS`), so a
client can refuse locally, with the server's own error code, what the server would refuse, and
knows the session's state without asking. :func:`as_data` gives the tables as JSON-ready
lists, for clients in other languages (generated, like the wire types). The state diagram and
the guards are in ``state.py``.
"""

from __future__ import annotations

import enum
import json

from vllm_realtime_protocol.errors import (
    BinaryUnexpected,
    ChunkInFlight,
    InternalError,
    NoResponseInFlight,
    RealtimeError,
    SessionAlreadyOpen,
    SessionClosed,
    SessionNotOpen,
)

__all__ = [
    "CLIENT_INPUTS",
    "REFUSALS",
    "REFUSED_PAYLOAD_STATE",
    "TRANSITIONS",
    "Input",
    "State",
    "as_data",
    "render",
]


class State(enum.Enum):
    """Where a connection's session stands."""

    CONNECTED = "connected"
    """Greeted with session.created; no session open yet."""
    IDLE = "idle"
    """Session open, no chunk in flight: frame.append is welcome."""
    AWAITING_BINARY = "awaiting_binary"
    """A ``binary: true`` frame.append arrived; its payload is the next binary message."""
    AWAITING_RESPONSE = "awaiting_response"
    """One chunk accepted; its reply is not finished."""
    CLOSED = "closed"
    """Session over; only the drain of an in-flight reply may still happen."""
    PARKED = "parked"
    """Resumable session whose connection dropped; waits for session.resume (no reply runs)."""
    PARKED_AWAITING_RESPONSE = "parked_awaiting_response"
    """Parked while its reply still runs; that reply's response.done is kept for the resume."""


class Input(enum.Enum):
    """Everything that can happen to a session (client events and server happenings)."""

    SESSION_OPEN = "session.open"
    FRAME_APPEND = "frame.append"
    """frame.append carrying its payload (image, video or text)."""
    FRAME_ANNOUNCE = "frame.append(binary)"
    """frame.append with ``binary: true``: the payload follows as a binary message."""
    BINARY = "binary"
    """A binary WebSocket message."""
    RESPONSE_CANCEL = "response.cancel"
    SESSION_CLOSE = "session.close"
    SESSION_RESUME = "session.resume"
    SESSION_UPDATE = "session.update"
    OPEN_REFUSED = "open_refused"
    """Server: admission refused the session just opened (e.g. capacity)."""
    RESPONSE_DONE = "response_done"
    """Server: the reply in flight finished (any status)."""
    ENGINE_ERROR = "engine_error"
    DISCONNECT = "disconnect"
    IDLE_TIMEOUT = "idle_timeout"
    SERVER_SHUTDOWN = "server_shutdown"
    FATAL_ERROR = "error"
    """Server: a non-surviving RealtimeError was sent; the session must end."""
    DETACH = "detach"
    """Server: the connection of a resumable session dropped; park the session."""
    RESUMED = "resumed"
    """Server: a new connection presented this parked session's token; it takes over."""
    EXPIRE = "expire"
    """Server: a parked session's grace period ran out."""


S = State
In = Input

_CLOSERS = (In.ENGINE_ERROR, In.DISCONNECT, In.IDLE_TIMEOUT, In.SERVER_SHUTDOWN, In.FATAL_ERROR)
_PARKED = (S.PARKED, S.PARKED_AWAITING_RESPONSE)
# Inputs a parked session never gets: nothing feeds it client events, and its idle clock is
# the grace period (EXPIRE), not the idle timeout.
_NOT_WHILE_PARKED = (
    In.SESSION_OPEN,
    In.FRAME_APPEND,
    In.FRAME_ANNOUNCE,
    In.BINARY,
    In.RESPONSE_CANCEL,
    In.SESSION_CLOSE,
    In.SESSION_RESUME,
    In.SESSION_UPDATE,
    In.OPEN_REFUSED,
    In.DISCONNECT,
    In.IDLE_TIMEOUT,
    In.DETACH,
)

TRANSITIONS: dict[tuple[State, Input], State] = {
    (S.CONNECTED, In.SESSION_OPEN): S.IDLE,
    (S.CONNECTED, In.SESSION_CLOSE): S.CLOSED,
    (S.IDLE, In.FRAME_APPEND): S.AWAITING_RESPONSE,
    (S.IDLE, In.FRAME_ANNOUNCE): S.AWAITING_BINARY,
    (S.IDLE, In.SESSION_CLOSE): S.CLOSED,
    (S.IDLE, In.OPEN_REFUSED): S.CONNECTED,  # guard: no chunk accepted yet
    (S.AWAITING_BINARY, In.BINARY): S.AWAITING_RESPONSE,
    (S.AWAITING_BINARY, In.SESSION_CLOSE): S.CLOSED,
    (S.AWAITING_RESPONSE, In.RESPONSE_CANCEL): S.AWAITING_RESPONSE,
    (S.AWAITING_RESPONSE, In.RESPONSE_DONE): S.IDLE,
    (S.AWAITING_RESPONSE, In.SESSION_CLOSE): S.CLOSED,
    (S.CLOSED, In.RESPONSE_DONE): S.CLOSED,  # guard: a reply was in flight at the close
    **{
        (state, inp): S.CLOSED
        for state in State
        for inp in _CLOSERS
        if (state, inp) not in ((p, i) for p in _PARKED for i in _NOT_WHILE_PARKED)
    },
    # Resumption.
    (S.CONNECTED, In.SESSION_RESUME): S.CONNECTED,  # the server looks the session up
    (S.IDLE, In.DETACH): S.PARKED,  # guard (all three): opened with resumable
    (S.AWAITING_BINARY, In.DETACH): S.PARKED,  # the announcement is dropped, never accepted
    (S.AWAITING_RESPONSE, In.DETACH): S.PARKED_AWAITING_RESPONSE,
    (S.PARKED_AWAITING_RESPONSE, In.RESPONSE_DONE): S.PARKED,  # kept for session.resumed
    (S.PARKED, In.RESUMED): S.IDLE,
    (S.PARKED_AWAITING_RESPONSE, In.RESUMED): S.AWAITING_RESPONSE,
    (S.PARKED, In.EXPIRE): S.CLOSED,
    (S.PARKED_AWAITING_RESPONSE, In.EXPIRE): S.CLOSED,
    (S.CLOSED, In.EXPIRE): S.CLOSED,  # like every server close: a no-op once closed
    # Settings from the next chunk on; a reply in flight keeps its own.
    (S.IDLE, In.SESSION_UPDATE): S.IDLE,
    (S.AWAITING_BINARY, In.SESSION_UPDATE): S.AWAITING_BINARY,
    (S.AWAITING_RESPONSE, In.SESSION_UPDATE): S.AWAITING_RESPONSE,
}
"""Allowed (state, input) pairs and the state each leads to."""

REFUSALS: dict[tuple[State, Input], type[RealtimeError]] = {
    (S.CONNECTED, In.FRAME_APPEND): SessionNotOpen,
    (S.CONNECTED, In.FRAME_ANNOUNCE): SessionNotOpen,
    (S.CONNECTED, In.BINARY): BinaryUnexpected,
    (S.CONNECTED, In.RESPONSE_CANCEL): SessionNotOpen,
    (S.CONNECTED, In.OPEN_REFUSED): InternalError,
    (S.CONNECTED, In.RESPONSE_DONE): InternalError,
    (S.IDLE, In.SESSION_OPEN): SessionAlreadyOpen,
    (S.IDLE, In.BINARY): BinaryUnexpected,
    (S.IDLE, In.RESPONSE_CANCEL): NoResponseInFlight,
    (S.IDLE, In.RESPONSE_DONE): InternalError,
    (S.AWAITING_BINARY, In.SESSION_OPEN): SessionAlreadyOpen,
    (S.AWAITING_BINARY, In.FRAME_APPEND): ChunkInFlight,
    (S.AWAITING_BINARY, In.FRAME_ANNOUNCE): ChunkInFlight,
    (S.AWAITING_BINARY, In.RESPONSE_CANCEL): NoResponseInFlight,
    (S.AWAITING_BINARY, In.OPEN_REFUSED): InternalError,
    (S.AWAITING_BINARY, In.RESPONSE_DONE): InternalError,
    (S.AWAITING_RESPONSE, In.SESSION_OPEN): SessionAlreadyOpen,
    (S.AWAITING_RESPONSE, In.FRAME_APPEND): ChunkInFlight,
    (S.AWAITING_RESPONSE, In.FRAME_ANNOUNCE): ChunkInFlight,
    (S.AWAITING_RESPONSE, In.BINARY): BinaryUnexpected,
    (S.AWAITING_RESPONSE, In.OPEN_REFUSED): InternalError,
    (S.CLOSED, In.SESSION_OPEN): SessionClosed,
    (S.CLOSED, In.FRAME_APPEND): SessionClosed,
    (S.CLOSED, In.FRAME_ANNOUNCE): SessionClosed,
    (S.CLOSED, In.BINARY): SessionClosed,
    (S.CLOSED, In.RESPONSE_CANCEL): SessionClosed,
    (S.CLOSED, In.SESSION_CLOSE): SessionClosed,
    (S.CLOSED, In.OPEN_REFUSED): InternalError,
    # Resumption.
    (S.IDLE, In.SESSION_RESUME): SessionAlreadyOpen,
    (S.AWAITING_BINARY, In.SESSION_RESUME): SessionAlreadyOpen,
    (S.AWAITING_RESPONSE, In.SESSION_RESUME): SessionAlreadyOpen,
    (S.CLOSED, In.SESSION_RESUME): SessionClosed,
    (S.CONNECTED, In.SESSION_UPDATE): SessionNotOpen,
    (S.CLOSED, In.SESSION_UPDATE): SessionClosed,
    **{(S.CONNECTED, inp): InternalError for inp in (In.DETACH, In.RESUMED, In.EXPIRE)},
    (S.CLOSED, In.DETACH): InternalError,
    (S.CLOSED, In.RESUMED): InternalError,
    **{
        (state, inp): InternalError
        for state in (S.IDLE, S.AWAITING_BINARY, S.AWAITING_RESPONSE)
        for inp in (In.RESUMED, In.EXPIRE)
    },
    (S.PARKED, In.RESPONSE_DONE): InternalError,
    **{(state, inp): InternalError for state in _PARKED for inp in _NOT_WHILE_PARKED},
}
"""Refused (state, input) pairs and the error each raises (state unchanged)."""

del S, In


CLIENT_INPUTS: frozenset[Input] = frozenset(
    {
        Input.SESSION_OPEN,
        Input.FRAME_APPEND,
        Input.FRAME_ANNOUNCE,
        Input.BINARY,
        Input.RESPONSE_CANCEL,
        Input.SESSION_CLOSE,
        Input.SESSION_RESUME,
        Input.SESSION_UPDATE,
    }
)
"""The inputs a client sends; every other input is a server happening."""

REFUSED_PAYLOAD_STATE: dict[Input, State] = {Input.BINARY: State.IDLE}
"""Where a refusal that the tables cannot foresee (a payload or setting the server's checks
refuse) leaves the session, where that is not the state before the input: a refused binary
payload still consumes its announcement."""


def as_data() -> dict[str, list[list[str]]]:
    """The tables as JSON-ready rows: ``transitions`` [state, input, next state], ``refusals``
    [state, input, error code], ``client_inputs`` [input] and ``refused_payload_state``
    [input, state] (enum values, as the wire and docs spell them)."""
    return {
        "transitions": [[s.value, i.value, n.value] for (s, i), n in TRANSITIONS.items()],
        "refusals": [[s.value, i.value, e.code] for (s, i), e in REFUSALS.items()],
        "client_inputs": [[i.value] for i in Input if i in CLIENT_INPUTS],
        "refused_payload_state": [[i.value, s.value] for i, s in REFUSED_PAYLOAD_STATE.items()],
    }


def render() -> str:
    """:func:`as_data` as committed for the JS client (``clients/js/protocol.tables.json``,
    written by ``make types``): one row a line, in the tables' order, a final newline."""
    sections = []
    for name, rows in as_data().items():
        lines = ",\n".join(f"    {json.dumps(row)}" for row in rows)
        sections.append(f'  "{name}": [\n{lines}\n  ]')
    return "{\n" + ",\n".join(sections) + "\n}\n"
