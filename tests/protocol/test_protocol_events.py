"""Unit tests of vllm_realtime_protocol.events: every event round-trips, inbound events are closed and strict."""

from __future__ import annotations

import re
import typing
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from strategies import JPEG, b64

from vllm_realtime_protocol import (
    CLIENT_EVENT_ADAPTER,
    PROTOCOL_VERSION,
    SERVER_EVENT_ADAPTER,
    ClientEvent,
    ErrorDetail,
    ErrorEvent,
    FrameAppendEvent,
    InputAckEvent,
    Limits,
    ResponseCancelEvent,
    ResponseCreatedEvent,
    ResponseDoneEvent,
    ResponseTextDeltaEvent,
    ResumableConfig,
    RetentionConfig,
    RetentionState,
    SamplingConfig,
    ServerDrainingEvent,
    ServerEvent,
    SessionClosedEvent,
    SessionCloseEvent,
    SessionConfig,
    SessionCreatedEvent,
    SessionOpenedEvent,
    SessionOpenEvent,
    SessionResumedEvent,
    SessionResumeEvent,
    SessionUpdatedEvent,
    SessionUpdateEvent,
    Timing,
    Usage,
    encode_client_event,
    encode_server_event,
    new_event_id,
    new_session_id,
    parse_client_event,
    parse_server_event,
)
from vllm_realtime_protocol.events import CLIENT_EVENT_TYPES, SERVER_EVENT_TYPES

LIMITS = Limits(server_version="0.1.0", model="test-model")

CLIENT_EVENTS: list[ClientEvent] = [
    SessionOpenEvent(),
    SessionOpenEvent(
        event_id="c1",
        instructions="Describe each frame.",
        modality="text",
        retention=RetentionConfig(
            sink_tokens=4, sink_chunks=0, window_chunks=None, window_tokens=9
        ),
        sampling=SamplingConfig(max_tokens=4096, temperature=2.0, top_p=0.5, seed=7),
        frame_format="png",
        model="test-model",
    ),
    FrameAppendEvent(image=b64(JPEG), prompt="what now?", timestamp=1.5, frame_id="f1"),
    FrameAppendEvent(text="hello"),
    FrameAppendEvent(video=b64(b"\x00\x00\x00\x18ftypisom")),
    FrameAppendEvent(binary=True, event_id="c2"),
    ResponseCancelEvent(),
    ResponseCancelEvent(event_id="c3"),
    SessionCloseEvent(),
    SessionResumeEvent(session_id="sess_1", resume_token="tok", event_id="r1"),
    SessionUpdateEvent(sampling=SamplingConfig(temperature=0.5), event_id="u1"),
]

SERVER_EVENTS: list[ServerEvent] = [
    SessionCreatedEvent(session_id="sess_1", limits=LIMITS),
    SessionOpenedEvent(
        session_id="sess_1", config=SessionConfig(model="test-model"), limits=LIMITS
    ),
    InputAckEvent(frame_index=0, frame_id="f1", bytes=20),
    ResponseCreatedEvent(frame_index=0, frame_id=None),
    ResponseTextDeltaEvent(frame_index=3, delta="A cat"),
    ResponseDoneEvent(
        frame_index=3,
        frame_id="f3",
        status="incomplete",
        status_reason="max_tokens",
        text="A cat on a mat",
        usage=Usage(prompt_tokens=300, completion_tokens=64),
        timing=Timing(queue_ms=1.0, ttft_ms=20.5, total_ms=200.0),
        retention=RetentionState(frames_retained=9, frames_evicted=3, tokens_retained=2900),
    ),
    ResponseDoneEvent(frame_index=0, status="completed"),
    SessionClosedEvent(session_id="sess_1", reason="idle_timeout", frames_total=12),
    ServerDrainingEvent(seconds_left=19.5),
    SessionUpdatedEvent(session_id="sess_1", config=SessionConfig()),
    SessionResumedEvent(
        session_id="sess_1",
        config=SessionConfig(model="test-model", resumable=ResumableConfig(grace_s=30.0)),
        limits=LIMITS,
        next_frame_index=4,
        in_flight_frame_index=None,
        missed_response=ResponseDoneEvent(frame_index=3, status="completed", text="hi"),
        resume_token="tok-2",
    ),
    ErrorEvent(
        error=ErrorDetail(
            type="invalid_request_error",
            code="chunk_in_flight",
            message="wait",
            event_id="c9",
            session_survives=True,
        )
    ),
]


def _id(ev: BaseModel) -> str:
    return str(getattr(ev, "type", type(ev).__name__))


def test_every_event_type_has_an_example() -> None:
    assert {e.type for e in CLIENT_EVENTS} == set(CLIENT_EVENT_TYPES)
    assert {e.type for e in SERVER_EVENTS} == set(SERVER_EVENT_TYPES)


def test_type_tables_match_the_unions() -> None:
    client_union = typing.get_args(typing.get_args(ClientEvent)[0])
    server_union = typing.get_args(typing.get_args(ServerEvent)[0])
    assert set(client_union) == set(CLIENT_EVENT_TYPES.values())
    assert set(server_union) == set(SERVER_EVENT_TYPES.values())
    for name, model in {**CLIENT_EVENT_TYPES, **SERVER_EVENT_TYPES}.items():
        assert model.model_fields["type"].default == name


@pytest.mark.parametrize("event", CLIENT_EVENTS, ids=_id)
def test_client_event_round_trip(event: ClientEvent) -> None:
    wire = encode_client_event(event)
    assert parse_client_event(wire) == event
    assert CLIENT_EVENT_ADAPTER.validate_json(wire) == event


@pytest.mark.parametrize("event", SERVER_EVENTS, ids=_id)
def test_server_event_round_trip(event: ServerEvent) -> None:
    wire = encode_server_event(event)
    assert parse_server_event(wire) == event
    assert SERVER_EVENT_ADAPTER.validate_json(wire.encode()) == event


@pytest.mark.parametrize("event", SERVER_EVENTS, ids=_id)
def test_server_events_carry_generated_ids_and_keep_nulls(event: ServerEvent) -> None:
    assert re.fullmatch(r"evt_[0-9a-f]{24}", event.event_id)
    wire = encode_server_event(event)
    assert wire.startswith('{"type":')
    # every field is present on the wire, null or not
    assert set(parse_server_event(wire).model_dump()) == set(type(event).model_fields)
    assert wire.count(":null") == sum(1 for v in _leaves(event.model_dump()) if v is None), (
        "exclude_none=False: nulls are sent"
    )


def _leaves(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [leaf for v in obj.values() for leaf in _leaves(v)]
    return [obj]


def test_ids_are_fresh() -> None:
    ids = {new_event_id() for _ in range(100)}
    assert len(ids) == 100
    assert re.fullmatch(r"sess_[0-9a-f]{32}", new_session_id())
    assert SessionCreatedEvent(session_id="s", limits=LIMITS).event_id != (
        SessionCreatedEvent(session_id="s", limits=LIMITS).event_id
    )


def test_server_events_ignore_unknown_fields() -> None:
    wire = '{"type":"response.text.delta","event_id":"evt_x","frame_index":1,"delta":"a","new":1}'
    assert parse_server_event(wire) == ResponseTextDeltaEvent(
        event_id="evt_x", frame_index=1, delta="a"
    )


def test_limits_default_protocol_version() -> None:
    assert LIMITS.protocol_version == PROTOCOL_VERSION == "2026-12-01"


# --------------------------------------------------------------------------- closed, strict inbound


@pytest.mark.parametrize("event", CLIENT_EVENTS, ids=_id)
def test_client_events_refuse_extra_fields(event: ClientEvent) -> None:
    data = event.model_dump(exclude_none=True) | {"surprise": 1}
    with pytest.raises(ValidationError, match="surprise"):
        CLIENT_EVENT_ADAPTER.validate_python(data)


@pytest.mark.parametrize(
    ("model", "data"),
    [
        (RetentionConfig, {"extra": 1}),
        (SamplingConfig, {"max_tokens": "64"}),  # strict: no string-to-int
        (SamplingConfig, {"max_tokens": 64.0}),
        (SamplingConfig, {"seed": True}),
        (FrameAppendEvent, {"text": "a", "binary": "true"}),
        (SessionOpenEvent, {"modality": "audio"}),
        (SessionOpenEvent, {"frame_format": "gif"}),
    ],
)
def test_inbound_is_strict(model: type[BaseModel], data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate(data)


@pytest.mark.parametrize(
    ("field", "bad", "good"),
    [
        ("max_tokens", [0, 4097, -1], [1, 64, 4096]),
        ("temperature", [-0.1, 2.01, float("nan"), float("inf")], [0.0, 0, 1.3, 2.0]),
        ("top_p", [0.0, 1.01, -1.0], [0.01, 1.0, 1]),
    ],
)
def test_sampling_bounds(field: str, bad: list[Any], good: list[Any]) -> None:
    for value in bad:
        with pytest.raises(ValidationError):
            SamplingConfig.model_validate({field: value})
    for value in good:
        assert getattr(SamplingConfig.model_validate({field: value}), field) == value


def test_sampling_defaults() -> None:
    assert SamplingConfig() == SamplingConfig(max_tokens=64, temperature=0.0, top_p=1.0, seed=None)


@pytest.mark.parametrize(
    "data",
    [
        {"sink_tokens": -1},
        {"sink_chunks": -1},
        {"window_chunks": 0},
        {"window_tokens": 0},
        {"window_chunks": None},  # enabled with nothing bounding the window
        {"window_chunks": None, "window_tokens": None},
    ],
)
def test_retention_refused(data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RetentionConfig.model_validate(data)


def test_retention_accepted() -> None:
    assert RetentionConfig() == RetentionConfig(
        enabled=True, sink_tokens=0, sink_chunks=1, window_chunks=8, window_tokens=None
    )
    assert RetentionConfig(enabled=False, window_chunks=None).window_chunks is None
    assert RetentionConfig(window_chunks=None, window_tokens=100).window_tokens == 100


def test_session_open_defaults_and_config() -> None:
    ev = SessionOpenEvent()
    assert (ev.modality, ev.frame_format, ev.model, ev.instructions) == (
        "video",
        "auto",
        None,
        None,
    )
    config = ev.session_config()
    assert type(config) is SessionConfig
    assert config.model_dump() == ev.model_dump(exclude={"type", "event_id"})


# --------------------------------------------------------------------------- exactly one payload

PAYLOADS: dict[str, Any] = {"image": b64(JPEG), "text": "hi", "video": b64(JPEG), "binary": True}


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_frame_append_one_payload_ok(name: str) -> None:
    ev = FrameAppendEvent.model_validate({name: PAYLOADS[name]})
    assert ev.payload_kind == name


@pytest.mark.parametrize(
    "names",
    [(), *[(a, b) for a in sorted(PAYLOADS) for b in sorted(PAYLOADS) if a < b], tuple(PAYLOADS)],
    ids=lambda names: "+".join(names) or "none",
)
def test_frame_append_needs_exactly_one_payload(names: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError, match="exactly one payload") as info:
        FrameAppendEvent.model_validate({n: PAYLOADS[n] for n in names})
    got = "none" if not names else " and ".join(repr(n) for n in sorted(names, key=_order))
    assert f"(got {got})" in str(info.value)


def _order(name: str) -> int:
    return ["image", "text", "video", "binary"].index(name)


def test_frame_append_binary_false_is_no_payload() -> None:
    with pytest.raises(ValidationError, match="got none"):
        FrameAppendEvent(binary=False)


@pytest.mark.parametrize("name", ["image", "text", "video"])
def test_frame_append_empty_payload_refused(name: str) -> None:
    with pytest.raises(ValidationError):
        FrameAppendEvent.model_validate({name: ""})


def test_frame_append_timestamp_must_be_finite() -> None:
    with pytest.raises(ValidationError):
        FrameAppendEvent(text="a", timestamp=float("inf"))


def test_event_id_length_capped() -> None:
    with pytest.raises(ValidationError):
        SessionCloseEvent(event_id="x" * 257)
    assert SessionCloseEvent(event_id="x" * 256).event_id == "x" * 256


# --------------------------------------------------------------------------- documentation


def _all_models() -> set[type[BaseModel]]:
    seen: set[type[BaseModel]] = set()
    todo: list[type[BaseModel]] = [*CLIENT_EVENT_TYPES.values(), *SERVER_EVENT_TYPES.values()]
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for info in model.model_fields.values():
            for arg in [info.annotation, *typing.get_args(info.annotation)]:
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    todo.append(arg)
    return seen


def test_every_field_is_documented() -> None:
    models = _all_models()
    assert {Limits, Usage, Timing, RetentionState, ErrorDetail, RetentionConfig} <= models
    for model in models:
        assert model.__doc__, model
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"


def test_import_is_pure() -> None:
    """protocol imports only the standard library and pydantic."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, vllm_realtime_protocol; "
        "print(sorted(m for m in ('asyncio', 'fastapi', 'vllm', 'torch', 'numpy', 'websockets') "
        "if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_frame_append_reply_defaults_to_true() -> None:
    assert FrameAppendEvent(text="x").reply is True
    assert FrameAppendEvent(text="x", reply=False).reply is False


def test_frame_append_format_needs_a_reply() -> None:
    # A reply format on an ingested chunk means nothing: refused rather than ignored.
    with pytest.raises(ValidationError, match="needs a reply"):
        FrameAppendEvent(text="x", reply=False, response_format={"type": "json_object"})


def test_response_format_openai_shape_round_trips() -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "event", "schema": {"type": "object"}, "strict": True},
    }
    event = SessionOpenEvent.model_validate({"sampling": {"response_format": fmt}})
    dumped = event.model_dump(mode="json", exclude_none=True)
    # The wire name is "schema" both ways (the attribute is schema_).
    assert dumped["sampling"]["response_format"] == fmt
    assert SessionOpenEvent.model_validate(dumped) == event


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": []}},
        {"type": "xml"},
        {"type": "json_object", "schema": {}},
    ],
)
def test_response_format_refused(fmt: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        SamplingConfig.model_validate({"response_format": fmt})
