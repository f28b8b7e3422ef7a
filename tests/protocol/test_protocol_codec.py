"""Unit tests of vllm_realtime_protocol.codec (parsing, encoding, payloads) and vllm_realtime_protocol.auth."""

from __future__ import annotations

import json

import pytest
from strategies import JPEG, MP4, PNG, WEBM, WEBP, b64

from vllm_realtime_protocol import (
    FrameAppendEvent,
    FrameTooLarge,
    InvalidEvent,
    InvalidJson,
    RealtimeError,
    SessionCloseEvent,
    SessionOpenEvent,
    UndecodableFrame,
    UnknownEventType,
    api_key_from_handshake,
    bearer_token,
    decode_base64_payload,
    key_from_subprotocols,
    parse_client_event,
    select_subprotocol,
    sniff_media,
)
from vllm_realtime_protocol.codec import base64_decoded_size


def test_parse_str_and_bytes() -> None:
    wire = '{"type":"session.close","event_id":"e1"}'
    assert parse_client_event(wire) == SessionCloseEvent(event_id="e1")
    assert parse_client_event(wire.encode()) == SessionCloseEvent(event_id="e1")


def test_parse_unicode_text() -> None:
    ev = parse_client_event('{"type":"frame.append","text":"¿qué ves? 👀"}')
    assert isinstance(ev, FrameAppendEvent)
    assert ev.text == "¿qué ves? 👀"


@pytest.mark.parametrize(
    ("data", "error", "fragment"),
    [
        (b"\xff\xfe", InvalidJson, "UTF-8"),
        ("", InvalidJson, "not valid JSON"),
        ("{", InvalidJson, "not valid JSON"),
        ('{"type":"session.close"} x', InvalidJson, "not valid JSON"),
        ("[]", InvalidJson, "not list"),
        ('"session.close"', InvalidJson, "not str"),
        ("null", InvalidJson, "not NoneType"),
        ('{"type":"session.open","sampling":{"temperature":NaN}}', InvalidJson, "NaN"),
        ('{"type":"session.open","sampling":{"temperature":-Infinity}}', InvalidJson, "Infinity"),
        ("[" * 100_000, InvalidJson, "nested"),
        ('{"type":"session.open","seed":' + "9" * 5000 + "}", InvalidJson, "not valid JSON"),
        ("{}", UnknownEventType, "no string 'type'"),
        ('{"type":null}', UnknownEventType, "no string 'type'"),
        ('{"type":["frame.append"]}', UnknownEventType, "no string 'type'"),
        ('{"type":"frame.appendx"}', UnknownEventType, "'frame.appendx'"),
        ('{"type":"response.done"}', UnknownEventType, "server event"),
        ('{"type":"session.open","modality":"audio"}', InvalidEvent, "session.open.modality"),
        ('{"type":"frame.append"}', InvalidEvent, "exactly one payload"),
        ('{"type":"frame.append","text":"a","colour":1}', InvalidEvent, "frame.append.colour"),
        (
            '{"type":"session.open","retention":{"window_chunks":0}}',
            InvalidEvent,
            "session.open.retention.window_chunks",
        ),
        ('{"type":"session.open","sampling":{"max_tokens":"9"}}', InvalidEvent, "max_tokens"),
    ],
)
def test_parse_refusals(data: str | bytes, error: type[RealtimeError], fragment: str) -> None:
    with pytest.raises(error) as info:
        parse_client_event(data)
    assert fragment in info.value.message
    assert info.type is error  # exactly this class, not a sibling


def test_parse_echoes_event_id_when_readable() -> None:
    with pytest.raises(InvalidEvent) as info:
        parse_client_event('{"type":"frame.append","event_id":"mine"}')
    assert info.value.event_id == "mine"
    with pytest.raises(UnknownEventType) as unknown:
        parse_client_event('{"type":"nope","event_id":"mine2"}')
    assert unknown.value.event_id == "mine2"
    with pytest.raises(InvalidEvent) as not_str:
        parse_client_event('{"type":"frame.append","event_id":5}')
    assert not_str.value.event_id is None
    with pytest.raises(InvalidEvent) as too_long:
        parse_client_event(json.dumps({"type": "frame.append", "event_id": "x" * 300}))
    assert too_long.value.event_id is None


def test_parse_counts_further_errors() -> None:
    with pytest.raises(InvalidEvent, match=r"and 2 more errors"):
        parse_client_event('{"type":"session.close","a":1,"b":2,"c":3}')


def test_parse_never_echoes_large_input() -> None:
    huge = "A" * 100_000
    cases = [
        json.dumps({"type": huge}),
        json.dumps({"type": "frame.append", huge: 1}),
        json.dumps({"type": "frame.append", "image": huge, "text": huge}),
        json.dumps({"type": "session.open", "modality": huge}),
        json.dumps({"type": "session.open", "instructions": 5, "model": [huge]}),
    ]
    for wire in cases:
        with pytest.raises(RealtimeError) as info:
            parse_client_event(wire)
        assert len(info.value.message) < 400, info.value.message


def test_parse_size_cap() -> None:
    wire = json.dumps({"type": "frame.append", "image": "A" * 1000})
    with pytest.raises(FrameTooLarge, match="limit is 100"):
        parse_client_event(wire, max_bytes=100)
    with pytest.raises(FrameTooLarge):
        parse_client_event(wire.encode(), max_bytes=100)
    assert parse_client_event(wire, max_bytes=len(wire)).type == "frame.append"
    # the cap counts UTF-8 bytes, not characters
    text = json.dumps({"type": "frame.append", "text": "é" * 50}, ensure_ascii=False)
    with pytest.raises(FrameTooLarge):
        parse_client_event(text, max_bytes=len(text))
    assert parse_client_event(text, max_bytes=len(text.encode())).type == "frame.append"


def test_parse_uses_whole_model() -> None:
    ev = parse_client_event('{"type":"session.open","sampling":{"max_tokens":5},"event_id":"o"}')
    assert ev == SessionOpenEvent.model_validate({"sampling": {"max_tokens": 5}, "event_id": "o"})


# --------------------------------------------------------------------------- payloads


@pytest.mark.parametrize(
    ("data", "fmt"),
    [(JPEG, "jpeg"), (PNG, "png"), (WEBP, "webp"), (MP4, "mp4"), (WEBM, "webm"), (b"GIF89a", None)],
)
def test_sniff_media(data: bytes, fmt: str | None) -> None:
    assert sniff_media(data) == fmt


def test_sniff_short_input() -> None:
    for n in range(12):
        assert sniff_media(b"\x00" * n) is None
    assert sniff_media(b"") is None


def test_decode_base64_payload() -> None:
    assert decode_base64_payload(b64(JPEG), max_bytes=len(JPEG)) == JPEG
    assert decode_base64_payload("data:image/jpeg;base64," + b64(JPEG), max_bytes=100) == JPEG
    for n in range(0, 20):
        assert base64_decoded_size(b64(b"x" * n)) >= n


@pytest.mark.parametrize(
    ("encoded", "error"),
    [
        ("not base64!", UndecodableFrame),
        ("QUJD\nREVG", UndecodableFrame),  # whitespace refused
        ("QUJ", UndecodableFrame),  # bad padding
        ("_-_-", UndecodableFrame),  # URL-safe alphabet refused
        ("é===", UndecodableFrame),
        ("", UndecodableFrame),
        ("data:image/jpeg," + b64(JPEG), UndecodableFrame),  # data URL without ;base64
        (b64(b"x" * 101), FrameTooLarge),
        (b64(b"x" * 99) + "A" * 400, FrameTooLarge),  # refused before decoding
    ],
)
def test_decode_base64_refusals(encoded: str, error: type[RealtimeError]) -> None:
    with pytest.raises(error):
        decode_base64_payload(encoded, max_bytes=100)


def test_decode_base64_exact_limit() -> None:
    for n in (98, 99, 100):
        assert len(decode_base64_payload(b64(b"x" * n), max_bytes=100)) == n


# --------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("header", "key"),
    [
        ("Bearer sk-1", "sk-1"),
        ("bearer   sk-2 ", "sk-2"),
        ("Basic abc", None),
        ("Bearer", None),
        ("Bearer ", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_token(header: str | None, key: str | None) -> None:
    assert bearer_token(header) == key


def test_subprotocol_key() -> None:
    assert key_from_subprotocols(["vllm-realtime", "vllm-realtime.auth.sk-3"]) == "sk-3"
    assert key_from_subprotocols(["vllm-realtime", "vllm-realtime.auth."]) is None
    assert key_from_subprotocols(["vllm-realtime"]) is None
    assert key_from_subprotocols([]) is None


def test_api_key_from_handshake_prefers_header() -> None:
    offered = ["vllm-realtime", "vllm-realtime.auth.sub"]
    assert api_key_from_handshake("Bearer head", offered) == "head"
    assert api_key_from_handshake(None, offered) == "sub"
    assert api_key_from_handshake(None, []) is None


def test_select_subprotocol_never_echoes_the_key() -> None:
    assert select_subprotocol(["vllm-realtime.auth.sk", "vllm-realtime"]) == "vllm-realtime"
    assert select_subprotocol(["vllm-realtime.auth.sk"]) is None
    assert select_subprotocol([]) is None


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ('{"type": "session.open", "retention": {"window_chunks": 0}}', "retention.window_chunks"),
        ('{"type": "session.open", "sampling": {"max_tokens": "8"}}', "sampling.max_tokens"),
        ('{"type": "frame.append", "image": "aGk=", "bogus": 1}', "bogus"),
        ('{"type": "frame.teleport"}', "type"),
        ('{"type": 7}', "type"),
        # Not one field: the event as a whole (exactly one payload) or the JSON itself.
        ('{"type": "frame.append", "image": "aGk=", "text": "x"}', None),
        ("[1]", None),
    ],
)
def test_error_param_names_the_offending_field(raw: str, param: str | None) -> None:
    from vllm_realtime_protocol import RealtimeError, parse_client_event
    from vllm_realtime_protocol.errors import error_event

    with pytest.raises(RealtimeError) as caught:
        parse_client_event(raw)
    assert caught.value.param == param
    assert error_event(caught.value).error.param == param  # and it reaches the wire


def test_error_param_is_a_path_never_a_value() -> None:
    from vllm_realtime_protocol import RealtimeError, parse_client_event

    secret = "s3cr3t-value-" + "x" * 200
    with pytest.raises(RealtimeError) as caught:
        parse_client_event(json.dumps({"type": "session.open", "instructions": 5, "model": secret}))
    assert caught.value.param == "instructions"
    assert secret not in (caught.value.param or "")
