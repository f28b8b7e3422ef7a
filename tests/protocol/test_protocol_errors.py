"""Unit tests of vllm_realtime_protocol.errors: the documented code table, and the wire error event."""

from __future__ import annotations

import pytest

import vllm_realtime_protocol
from vllm_realtime_protocol import (
    ERROR_CLASSES,
    CapacityExceeded,
    ChunkInFlight,
    ErrorEvent,
    InternalError,
    InvalidEvent,
    RealtimeError,
    encode_server_event,
    error_event,
    parse_server_event,
)
from vllm_realtime_protocol.constants import MAX_ERROR_MESSAGE_CHARS
from vllm_realtime_protocol.errors import truncate

# code -> (class name, type, session_survives); must match errors.py's docstring and the docs.
TABLE: dict[str, tuple[str, str, bool]] = {
    "invalid_request": ("InvalidRequestError", "invalid_request_error", True),
    "invalid_json": ("InvalidJson", "invalid_request_error", True),
    "invalid_event": ("InvalidEvent", "invalid_request_error", True),
    "unknown_event_type": ("UnknownEventType", "invalid_request_error", True),
    "session_not_open": ("SessionNotOpen", "invalid_request_error", True),
    "session_already_open": ("SessionAlreadyOpen", "invalid_request_error", True),
    "chunk_in_flight": ("ChunkInFlight", "invalid_request_error", True),
    "no_response_in_flight": ("NoResponseInFlight", "invalid_request_error", True),
    "frame_too_large": ("FrameTooLarge", "invalid_request_error", True),
    "undecodable_frame": ("UndecodableFrame", "invalid_request_error", True),
    "binary_unexpected": ("BinaryUnexpected", "invalid_request_error", True),
    "chunk_too_large": ("ChunkTooLarge", "invalid_request_error", True),
    "context_exceeded": ("ContextExceeded", "invalid_request_error", False),
    "session_closed": ("SessionClosed", "invalid_request_error", False),
    "session_not_found": ("SessionNotFound", "invalid_request_error", False),
    "capacity_exceeded": ("CapacityExceeded", "capacity_error", True),
    "rate_limited": ("RateLimited", "capacity_error", True),
    "unauthorized": ("Unauthorized", "auth_error", False),
    "idle_timeout": ("IdleTimeout", "timeout_error", False),
    "engine_error": ("EngineError", "server_error", False),
    "internal_error": ("InternalError", "server_error", False),
}


def test_table_covers_every_class_once() -> None:
    assert sorted(cls.code for cls in ERROR_CLASSES) == sorted(TABLE)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.code)
def test_class_attributes(cls: type[RealtimeError]) -> None:
    name, type_, survives = TABLE[cls.code]
    assert cls.__name__ == name
    assert getattr(vllm_realtime_protocol, name) is cls
    assert (cls.type, cls.session_survives) == (type_, survives)
    assert issubclass(cls, RealtimeError)
    assert cls.__doc__


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.code)
def test_docstring_tree_and_docs_name_every_code(cls: type[RealtimeError]) -> None:
    import vllm_realtime_protocol.errors as module

    assert module.__doc__ is not None
    line = next(ln for ln in module.__doc__.splitlines() if f" {cls.__name__} " in ln)
    assert cls.code in line
    assert ("survives" if cls.session_survives else "fatal") in line


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.code)
def test_error_event_echoes(cls: type[RealtimeError]) -> None:
    exc = cls("it broke", event_id="client_7")
    ev = error_event(exc)
    assert isinstance(ev, ErrorEvent)
    assert ev.error.model_dump() == {
        "type": cls.type,
        "code": cls.code,
        "message": "it broke",
        "event_id": "client_7",
        "session_survives": cls.session_survives,
        "param": None,
    }
    assert parse_server_event(encode_server_event(ev)) == ev


def test_defaults_and_str() -> None:
    exc = ChunkInFlight()
    assert exc.message == ChunkInFlight.default_message
    assert exc.event_id is None
    assert str(exc) == f"chunk_in_flight: {exc.message}"
    assert "ChunkInFlight" in repr(exc)
    assert error_event(exc).error.event_id is None


def test_capacity_exceeded_keeps_connection() -> None:
    assert CapacityExceeded.session_survives is True
    assert InternalError.session_survives is False


def test_messages_are_capped() -> None:
    exc = InvalidEvent("x" * 10_000)
    assert len(exc.message) == MAX_ERROR_MESSAGE_CHARS
    assert exc.message.endswith("…")


def test_messages_and_ids_are_wire_safe() -> None:
    exc = InvalidEvent("bad \ud800 key", event_id="\udc00")
    assert exc.event_id is None
    assert "\\ud800" in exc.message
    encode_server_event(error_event(exc))  # does not raise


@pytest.mark.parametrize(
    ("text", "limit", "out"),
    [("abc", 3, "abc"), ("abcd", 3, "ab…"), ("", 0, ""), ("ab", 1, "…"), ("abc", 0, "")],
)
def test_truncate(text: str, limit: int, out: str) -> None:
    assert truncate(text, limit) == out
