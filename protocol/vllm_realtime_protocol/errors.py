"""The one error tree of the protocol; every refusal the server sends is one of these.

:class:`VllmRealtimeError` is the root of every exception the protocol and its clients raise:
:class:`RealtimeError` (the wire's errors, below) and the clients' own failures on their side of
the socket (the Python SDK's ``ClientError``: a broken connection, a client-side timeout).

Each class fixes three things the client sees in an ``error`` event: ``code``
(machine readable, stable), ``type`` (the broad class), and
``session_survives`` (whether the connection, and the session if one is open,
stays usable after the error).  When ``session_survives`` is false the server
follows the ``error`` with ``session.closed`` and closes the WebSocket.

::

    RealtimeError
    ├── InvalidRequestError          invalid_request         survives  type="invalid_request_error"
    │   ├── InvalidJson              invalid_json            survives
    │   ├── InvalidEvent             invalid_event           survives
    │   ├── UnknownEventType         unknown_event_type      survives
    │   ├── SessionNotOpen           session_not_open        survives
    │   ├── SessionAlreadyOpen       session_already_open    survives
    │   ├── ChunkInFlight            chunk_in_flight         survives
    │   ├── NoResponseInFlight       no_response_in_flight   survives
    │   ├── FrameTooLarge            frame_too_large         survives
    │   ├── UndecodableFrame         undecodable_frame       survives
    │   ├── BinaryUnexpected         binary_unexpected       survives
    │   ├── ChunkTooLarge            chunk_too_large         survives
    │   ├── ContextExceeded          context_exceeded        fatal
    │   ├── SessionClosed            session_closed          fatal
    │   └── SessionNotFound          session_not_found       fatal
    ├── CapacityError                type="capacity_error"
    │   ├── CapacityExceeded         capacity_exceeded       survives
    │   └── RateLimited              rate_limited            survives
    ├── AuthError                    type="auth_error"
    │   └── Unauthorized             unauthorized            fatal
    ├── RealtimeTimeout              type="timeout_error"
    │   └── IdleTimeout              idle_timeout            fatal
    └── ServerError                  type="server_error"
        ├── EngineError              engine_error            fatal
        └── InternalError            internal_error          fatal

Raise them with a message and the ``event_id`` of the client event being
answered; :func:`error_event` turns one into the wire ``error`` event.
Messages are capped at ``MAX_ERROR_MESSAGE_CHARS``; code that builds a
message from client input must still quote it through :func:`truncate`.
"""

from __future__ import annotations

from typing import ClassVar

from vllm_realtime_protocol.constants import MAX_ERROR_MESSAGE_CHARS, MAX_PARAM_CHARS
from vllm_realtime_protocol.events import ErrorDetail, ErrorEvent, ErrorType

__all__ = [
    "ERROR_CLASSES",
    "AuthError",
    "BinaryUnexpected",
    "CapacityError",
    "CapacityExceeded",
    "ChunkInFlight",
    "ChunkTooLarge",
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
    "ServerError",
    "SessionAlreadyOpen",
    "SessionClosed",
    "SessionNotFound",
    "SessionNotOpen",
    "Unauthorized",
    "UndecodableFrame",
    "UnknownEventType",
    "VllmRealtimeError",
    "error_event",
    "truncate",
]


def truncate(text: str, limit: int = 80) -> str:
    """Return ``text`` cut to at most ``limit`` characters, marking the cut with '…'."""
    if len(text) <= limit:
        return text
    if limit <= 0:
        return ""
    return text[: limit - 1] + "…"


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates, e.g. from a JSON "\\ud800" escape
        return False
    return True


def _wire_safe(text: str) -> str:
    """``text`` with anything UTF-8 cannot carry (lone surrogates) backslash-escaped."""
    if _encodable(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class VllmRealtimeError(Exception):
    """Root of every exception of the protocol and its clients: ``except VllmRealtimeError``
    catches a server's refusal and a client's local failure alike."""


class RealtimeError(VllmRealtimeError):
    """Base of every protocol error; subclasses fix ``code``, ``type`` and ``session_survives``."""

    code: ClassVar[str] = "internal_error"
    type: ClassVar[ErrorType] = "server_error"
    session_survives: ClassVar[bool] = False
    default_message: ClassVar[str] = "Internal error."

    message: str
    event_id: str | None
    param: str | None

    def __init__(
        self, message: str | None = None, *, event_id: str | None = None, param: str | None = None
    ) -> None:
        text = _wire_safe(message or self.default_message)
        self.message = truncate(text, MAX_ERROR_MESSAGE_CHARS)
        self.event_id = event_id if event_id is None or _encodable(event_id) else None
        # The offending field's dotted path in the client event ("retention.window_chunks");
        # None when no single field is at fault. Never the field's value.
        self.param = truncate(_wire_safe(param), MAX_PARAM_CHARS) if param else None
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, event_id={self.event_id!r})"


# --------------------------------------------------------------------------- invalid requests


class InvalidRequestError(RealtimeError):
    """The client sent something the protocol refuses."""

    code = "invalid_request"
    type = "invalid_request_error"
    session_survives = True
    default_message = "Invalid request."


class InvalidJson(InvalidRequestError):
    """A text message was not UTF-8, not JSON, not a JSON object, or over the size cap."""

    code = "invalid_json"
    default_message = "Message is not a JSON object."


class InvalidEvent(InvalidRequestError):
    """The event failed schema validation; the message names the field, never echoes it."""

    code = "invalid_event"
    default_message = "Event failed validation."


class UnknownEventType(InvalidRequestError):
    """The object had no string ``type``, or one that is not a client event."""

    code = "unknown_event_type"
    default_message = "Unknown event type."


class SessionNotOpen(InvalidRequestError):
    """frame.append or response.cancel before session.open."""

    code = "session_not_open"
    default_message = "No session is open; send session.open first."


class SessionAlreadyOpen(InvalidRequestError):
    """A second session.open on a connection: one session per connection."""

    code = "session_already_open"
    default_message = "A session is already open on this connection."


class ChunkInFlight(InvalidRequestError):
    """frame.append while the previous chunk's reply (or binary payload) is pending."""

    code = "chunk_in_flight"
    default_message = "A chunk is already in flight; wait for its response.done."


class NoResponseInFlight(InvalidRequestError):
    """response.cancel with no reply in flight (also while a binary payload is awaited)."""

    code = "no_response_in_flight"
    default_message = "There is no response in flight to cancel."


class FrameTooLarge(InvalidRequestError):
    """A chunk payload (or a whole text message) exceeded the server's limits."""

    code = "frame_too_large"
    default_message = "Frame is larger than limits.max_frame_bytes."


class UndecodableFrame(InvalidRequestError):
    """A payload was not valid base64, or not an accepted media format."""

    code = "undecodable_frame"
    default_message = "Frame payload could not be decoded."


class BinaryUnexpected(InvalidRequestError):
    """A binary WebSocket message arrived with no pending ``binary: true`` frame.append."""

    code = "binary_unexpected"
    default_message = "Binary message without a pending frame.append with binary: true."


class ChunkTooLarge(InvalidRequestError):
    """A chunk is longer than limits.max_chunk_tokens; it was not run, the session goes on."""

    code = "chunk_too_large"
    default_message = "The chunk has more tokens than limits.max_chunk_tokens."


class ContextExceeded(InvalidRequestError):
    """The session's context is full (retention disabled, or a chunk bigger than the window).

    Fatal: the long-lived request cannot take more input; reopen with
    retention enabled or smaller chunks.
    """

    code = "context_exceeded"
    session_survives = False
    default_message = "The session's context window is full."


class SessionClosed(InvalidRequestError):
    """Any client input after the session closed."""

    code = "session_closed"
    session_survives = False
    default_message = "The session is closed."


class SessionNotFound(InvalidRequestError):
    """A connection or control request named a session id that does not exist."""

    code = "session_not_found"
    session_survives = False
    default_message = "No such session."


# --------------------------------------------------------------------------- capacity


class CapacityError(RealtimeError):
    """The server is too busy; trying again later may work."""

    code = "capacity"
    type = "capacity_error"
    session_survives = True
    default_message = "Server is at capacity."


class CapacityExceeded(CapacityError):
    """session.open refused: all ``max_sessions`` are taken.

    ``session_survives`` is true in the sense that the *connection* stays
    usable: no session is open, and the client may send session.open again.
    """

    code = "capacity_exceeded"
    default_message = "All sessions are in use; retry session.open later."


class RateLimited(CapacityError):
    """The client sends faster than the server accepts; the event was dropped."""

    code = "rate_limited"
    default_message = "Too many requests; slow down."


# --------------------------------------------------------------------------- auth


class AuthError(RealtimeError):
    """Authentication or authorization failed."""

    code = "auth"
    type = "auth_error"
    session_survives = False
    default_message = "Not authorized."


class Unauthorized(AuthError):
    """Missing or wrong API key (Authorization: Bearer, or the auth subprotocol)."""

    code = "unauthorized"
    default_message = "Missing or invalid API key."


# --------------------------------------------------------------------------- timeouts


class RealtimeTimeout(RealtimeError):
    """The session ended because a clock ran out."""

    code = "timeout"
    type = "timeout_error"
    session_survives = False
    default_message = "Timed out."


class IdleTimeout(RealtimeTimeout):
    """No client event for ``limits.idle_timeout_s`` seconds."""

    code = "idle_timeout"
    default_message = "Session idle for too long."


# --------------------------------------------------------------------------- server


class ServerError(RealtimeError):
    """The server failed; not the client's fault."""

    code = "server_error"
    type = "server_error"
    session_survives = False
    default_message = "Server error."


class EngineError(ServerError):
    """The vLLM engine failed or died; the long-lived request is gone."""

    code = "engine_error"
    default_message = "The inference engine failed."


class InternalError(ServerError):
    """A bug in the server (e.g. a server-side input in a state that cannot take it)."""

    code = "internal_error"
    default_message = "Internal server error."


ERROR_CLASSES: tuple[type[RealtimeError], ...] = (
    InvalidRequestError,  # raised as is where no narrower code fits (e.g. a budget that cannot fit)
    InvalidJson,
    InvalidEvent,
    UnknownEventType,
    SessionNotOpen,
    SessionAlreadyOpen,
    ChunkInFlight,
    NoResponseInFlight,
    FrameTooLarge,
    UndecodableFrame,
    BinaryUnexpected,
    ChunkTooLarge,
    ContextExceeded,
    SessionClosed,
    SessionNotFound,
    CapacityExceeded,
    RateLimited,
    Unauthorized,
    IdleTimeout,
    EngineError,
    InternalError,
)
"""Every concrete error class, one per wire ``code``."""


def error_event(exc: RealtimeError) -> ErrorEvent:
    """Build the wire ``error`` event for ``exc``, echoing the client's ``exc.event_id``."""
    return ErrorEvent(
        error=ErrorDetail(
            type=exc.type,
            code=exc.code,
            message=exc.message,
            event_id=exc.event_id,
            session_survives=exc.session_survives,
            param=exc.param,
        )
    )
