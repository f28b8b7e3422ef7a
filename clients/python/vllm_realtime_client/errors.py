"""Exceptions raised by the client.

Every ``error`` event the server sends becomes an instance of the protocol's own error class for
its code (:mod:`vllm_realtime_protocol.errors`, re-exported here): ``chunk_in_flight`` is
:class:`ChunkInFlight`, ``context_exceeded`` is :class:`ContextExceeded`, and so on.  Catch a
branch of the tree to catch a family::

    RealtimeError
    ├── InvalidRequestError   (InvalidEvent, ChunkInFlight, FrameTooLarge, ContextExceeded, …)
    ├── CapacityError         (CapacityExceeded, RateLimited)
    ├── AuthError             (Unauthorized: also a handshake refused with HTTP 401/403)
    ├── RealtimeTimeout       (IdleTimeout: the *server's* idle clock ran out)
    └── ServerError           (EngineError, InternalError)

Failures on the client's side of the socket are :class:`ClientError`\\ s:
:class:`ConnectError` (the handshake failed), :class:`ConnectionLost` (the socket went away
without a ``session.closed``) and :class:`ResponseTimeout` (a reply took longer than the
client's ``timeout``; also a :class:`TimeoutError`).  Both trees share one root,
:class:`VllmRealtimeError`: ``except VllmRealtimeError`` catches anything this client raises
for the session (each ``code`` is the JS client's code for the same failure).
"""

from __future__ import annotations

from typing import ClassVar

from vllm_realtime_protocol.errors import (
    ERROR_CLASSES,
    AuthError,
    BinaryUnexpected,
    CapacityError,
    CapacityExceeded,
    ChunkInFlight,
    ContextExceeded,
    EngineError,
    FrameTooLarge,
    IdleTimeout,
    InternalError,
    InvalidEvent,
    InvalidJson,
    InvalidRequestError,
    NoResponseInFlight,
    RateLimited,
    RealtimeError,
    RealtimeTimeout,
    ServerError,
    SessionAlreadyOpen,
    SessionClosed,
    SessionNotFound,
    SessionNotOpen,
    Unauthorized,
    UndecodableFrame,
    UnknownEventType,
    VllmRealtimeError,
)
from vllm_realtime_protocol.events import ErrorDetail, ErrorType

__all__ = [
    "AuthError",
    "BinaryUnexpected",
    "CapacityError",
    "CapacityExceeded",
    "ChunkInFlight",
    "ClientError",
    "ConnectError",
    "ConnectionLost",
    "ContextExceeded",
    "EngineError",
    "FrameTooLarge",
    "IdleTimeout",
    "InternalError",
    "InvalidEvent",
    "InvalidJson",
    "InvalidRequestError",
    "NoResponseInFlight",
    "RateLimited",
    "RealtimeError",
    "RealtimeTimeout",
    "ResponseTimeout",
    "ServerError",
    "SessionAlreadyOpen",
    "SessionClosed",
    "SessionNotFound",
    "SessionNotOpen",
    "Unauthorized",
    "UndecodableFrame",
    "UnknownEventType",
    "VllmRealtimeError",
    "error_class_for",
    "error_from_detail",
]

_BY_CODE: dict[str, type[RealtimeError]] = {cls.code: cls for cls in ERROR_CLASSES}
_BY_TYPE: dict[ErrorType, type[RealtimeError]] = {
    "invalid_request_error": InvalidRequestError,
    "capacity_error": CapacityError,
    "auth_error": AuthError,
    "timeout_error": RealtimeTimeout,
    "server_error": ServerError,
}


class ClientError(VllmRealtimeError):
    """A failure on the client's side of the socket (not an ``error`` event)."""

    code: ClassVar[str] = "client_error"


class ConnectError(ClientError):
    """The WebSocket handshake failed, or the server did not greet with ``session.created``."""

    code: ClassVar[str] = "connection_failed"


class ConnectionLost(ClientError):
    """The socket closed (or broke) before the server sent ``session.closed``."""

    code: ClassVar[str] = "connection_lost"


class ResponseTimeout(ClientError, TimeoutError):
    """A reply (or another answer) did not come within the client's timeout.

    A reply that timed out is cancelled (``response.cancel`` is sent); the session stays usable
    once its ``response.done`` has arrived.
    """

    code: ClassVar[str] = "timeout"


def error_class_for(code: str, error_type: ErrorType) -> type[RealtimeError]:
    """The exception class of a wire error code; for a code this client does not know, the
    base class of its ``type`` (a newer server may add codes)."""
    return _BY_CODE.get(code) or _BY_TYPE.get(error_type, RealtimeError)


def error_from_detail(detail: ErrorDetail) -> RealtimeError:
    """The exception for the body of an ``error`` event (its ``event_id`` is kept).

    Whether the session survives is the *server's* word (``detail.session_survives``); for
    known codes it always equals the class's ``session_survives``.
    """
    cls = error_class_for(detail.code, detail.type)
    message = detail.message if cls.code == detail.code else f"[{detail.code}] {detail.message}"
    return cls(message, event_id=detail.event_id, param=detail.param)
