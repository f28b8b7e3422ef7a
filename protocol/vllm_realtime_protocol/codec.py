"""Bytes ⇄ events: parse client messages, encode server events, decode frame payloads.

``parse_client_event`` is the one door wire input comes through, and it
raises nothing but :class:`~vllm_realtime_protocol.errors.RealtimeError` subclasses:

* ``frame_too_large``    – the message is over ``max_bytes`` UTF-8 bytes (checked first);
* ``invalid_json``       – not UTF-8, not strict JSON (``NaN``/``Infinity`` refused),
  too deeply nested, or not a JSON object;
* ``unknown_event_type`` – ``type`` missing, not a string, or not a client event;
* ``invalid_event``      – the event failed its model; the message names the field.

Errors carry the client's ``event_id`` whenever it could be read.

Encoding choice: events are encoded with every field present, ``null``
included (``model_dump_json(exclude_none=False)``), so each event type has one
fixed shape a reader can rely on.  Leaving nulls out is not an option: some
nullable fields have non-null defaults (``retention.window_chunks`` defaults to
8, ``null`` means "no cap"), so dropping a null would change the meaning.
Clients may of course omit any field whose default they want.
"""

from __future__ import annotations

import binascii
import json
from typing import Literal, NoReturn, TypeAlias

from pydantic import ValidationError

from vllm_realtime_protocol.constants import DEFAULT_MAX_EVENT_BYTES, MAX_EVENT_ID_CHARS
from vllm_realtime_protocol.errors import (
    FrameTooLarge,
    InvalidEvent,
    InvalidJson,
    UndecodableFrame,
    UnknownEventType,
    truncate,
)
from vllm_realtime_protocol.events import (
    CLIENT_EVENT_TYPES,
    SERVER_EVENT_ADAPTER,
    SERVER_EVENT_TYPES,
    ClientEvent,
    ServerEvent,
    SessionUpdateEvent,
)

__all__ = [
    "MediaFormat",
    "base64_decoded_size",
    "decode_base64_payload",
    "encode_client_event",
    "encode_server_event",
    "parse_client_event",
    "parse_server_event",
    "sniff_media",
]

MediaFormat: TypeAlias = Literal["jpeg", "png", "webp", "mp4", "webm"]

_MAX_LOC_PART_CHARS = 40
_MAX_VALIDATION_MESSAGE_CHARS = 300


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def _utf8_size(text: str) -> int:
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def parse_client_event(
    data: str | bytes, *, max_bytes: int = DEFAULT_MAX_EVENT_BYTES
) -> ClientEvent:
    """Parse one WebSocket text message into a client event.

    ``data`` is the message as received (``str`` from a text frame, or its UTF-8
    ``bytes``).  Messages over ``max_bytes`` UTF-8 bytes are refused with
    ``frame_too_large`` before any parsing.  Raises only ``RealtimeError``.
    """
    size = len(data) if isinstance(data, bytes) else _utf8_size(data)
    if size > max_bytes:
        raise FrameTooLarge(f"message is {size} bytes; the limit is {max_bytes}")
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidJson(f"message is not valid UTF-8 (byte {exc.start})") from None
    else:
        text = data
    try:
        obj = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise InvalidJson("message is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, over-long integers
        raise InvalidJson(f"message is not valid JSON: {truncate(str(exc), 120)}") from None
    if not isinstance(obj, dict):
        raise InvalidJson(f"message must be a JSON object, not {type(obj).__name__}")

    raw_id = obj.get("event_id")
    event_id = raw_id if isinstance(raw_id, str) and len(raw_id) <= MAX_EVENT_ID_CHARS else None

    event_type = obj.get("type")
    if not isinstance(event_type, str):
        raise UnknownEventType("event has no string 'type'", event_id=event_id, param="type")
    model = CLIENT_EVENT_TYPES.get(event_type)
    if model is None:
        shown = truncate(event_type, 60)
        hint = " (that is a server event)" if event_type in SERVER_EVENT_TYPES else ""
        expected = ", ".join(CLIENT_EVENT_TYPES)
        raise UnknownEventType(
            f"unknown event type {shown!r}{hint}; expected one of {expected}",
            event_id=event_id,
            param="type",
        )
    try:
        event: ClientEvent = model.model_validate(obj)
    except ValidationError as exc:
        raise InvalidEvent(
            _describe(event_type, exc), event_id=event_id, param=_first_param(exc)
        ) from None
    return event


def _first_param(exc: ValidationError) -> str | None:
    """The dotted path of the first failing field (``retention.window_chunks``); None for an
    event-level failure (e.g. not exactly one payload)."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    loc = [str(part) for part in errors[0]["loc"] if not isinstance(part, int)]
    return ".".join(truncate(part, _MAX_LOC_PART_CHARS) for part in loc) or None


def _describe(event_type: str, exc: ValidationError) -> str:
    """One short line naming the first failing field, without echoing the input."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    first = errors[0]
    loc = ".".join(truncate(str(part), _MAX_LOC_PART_CHARS) for part in first["loc"])
    where = f"{event_type}.{loc}" if loc else event_type
    message = f"{where}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return truncate(message, _MAX_VALIDATION_MESSAGE_CHARS)


def encode_server_event(event: ServerEvent) -> str:
    """Serialize a server event to its JSON text message (every field present, nulls kept)."""
    return event.model_dump_json(exclude_none=False)


def parse_server_event(data: str | bytes) -> ServerEvent:
    """Parse a server message (for clients and tests); raises ``pydantic.ValidationError``."""
    return SERVER_EVENT_ADAPTER.validate_json(data)


def encode_client_event(event: ClientEvent) -> str:
    """Serialize a client event to its JSON text message (every field present, nulls kept;
    a ``session.update`` carries only the fields it sets: the absent ones stay unchanged)."""
    if isinstance(event, SessionUpdateEvent):
        fields = event.model_dump(mode="json", exclude_unset=True)
        return json.dumps({"type": event.type, **fields}, separators=(",", ":"))
    return event.model_dump_json(exclude_none=False)


# --------------------------------------------------------------------------- payloads


def base64_decoded_size(encoded: str) -> int:
    """Upper bound on the bytes ``encoded`` decodes to, computed without decoding."""
    return (len(encoded) + 3) // 4 * 3


def decode_base64_payload(encoded: str, *, max_bytes: int) -> bytes:
    """Decode a base64 frame payload, refusing it before decoding if it would be too large.

    A data-URL prefix (``data:image/jpeg;base64,``, what ``canvas.toDataURL()``
    returns) is accepted and dropped.  Raises ``frame_too_large`` over
    ``max_bytes`` and ``undecodable_frame`` for anything that is not strict
    base64 (whitespace and the URL-safe alphabet are refused) or decodes to nothing.
    """
    if encoded.startswith("data:"):
        head, sep, rest = encoded.partition(",")
        if not sep or not head.endswith(";base64"):
            raise UndecodableFrame("data URL payloads must be base64 ('data:<type>;base64,...')")
        encoded = rest
    if base64_decoded_size(encoded) > max_bytes + 2:
        raise FrameTooLarge(
            f"payload decodes to about {base64_decoded_size(encoded)} bytes; "
            f"the limit is {max_bytes}"
        )
    try:
        data = binascii.a2b_base64(encoded.encode("ascii"), strict_mode=True)
    except (UnicodeEncodeError, binascii.Error):
        raise UndecodableFrame("payload is not valid base64") from None
    if len(data) > max_bytes:
        raise FrameTooLarge(f"payload is {len(data)} bytes; the limit is {max_bytes}")
    if not data:
        raise UndecodableFrame("payload is empty")
    return data


def sniff_media(data: bytes) -> MediaFormat | None:
    """Name the container of ``data`` from its magic bytes, or None if not one we accept."""
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[4:8] == b"ftyp":
        return "mp4"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "webm"
    return None
