"""Property and fuzz tests: wire input and input sequences fail only with RealtimeError."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import b64, json_values, machine_ops, typed_dicts

from vllm_realtime_protocol import (
    CloseSession,
    FrameAppendEvent,
    Limits,
    RealtimeError,
    ResponseCancelEvent,
    SessionCloseEvent,
    SessionOpenEvent,
    SessionProtocol,
    State,
    SubmitFrame,
    encode_client_event,
    encode_server_event,
    error_event,
    parse_client_event,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _parse_or_refuse(data: str | bytes) -> None:
    try:
        event = parse_client_event(data, max_bytes=4096)
    except RealtimeError as exc:
        # the refusal itself is always sendable, and short
        wire = encode_server_event(error_event(exc))
        assert len(exc.message) <= 500
        assert json.loads(wire)["error"]["code"] == exc.code
    else:
        assert parse_client_event(encode_client_event(event)) == event


@FAST
@given(st.binary(max_size=200))
def test_arbitrary_bytes(data: bytes) -> None:
    _parse_or_refuse(data)


@FAST
@given(st.text(max_size=200))
def test_arbitrary_text(data: str) -> None:
    _parse_or_refuse(data)


@FAST
@given(json_values)
def test_arbitrary_json(value: Any) -> None:
    _parse_or_refuse(json.dumps(value))


@FAST
@given(typed_dicts())
def test_arbitrary_dicts_with_a_valid_type(obj: dict[str, Any]) -> None:
    _parse_or_refuse(json.dumps(obj))


@FAST
@given(typed_dicts(), st.sampled_from(["\ud800", "\udfff", "\x00", "\u2028"]))
def test_unpaired_surrogates_and_controls(obj: dict[str, Any], odd: str) -> None:
    obj = {**obj, odd: odd, "event_id": odd}
    _parse_or_refuse(json.dumps(obj))


# --------------------------------------------------------------------------- the state machine

LIMITS = Limits(server_version="0.1.0", model="test-model", max_frame_bytes=1000)


def _step(proto: SessionProtocol, op: str, arg: Any) -> object:
    if op == "open":
        return proto.receive_client_event(SessionOpenEvent.model_validate(arg))
    if op == "append":
        if "image_b64" in arg:
            return proto.receive_client_event(FrameAppendEvent(image=arg["image_b64"]))
        payload = {k: b64(v) if isinstance(v, bytes) else v for k, v in arg.items()}
        return proto.receive_client_event(FrameAppendEvent.model_validate(payload))
    if op == "binary":
        return proto.receive_binary(arg)
    if op == "cancel":
        return proto.receive_client_event(ResponseCancelEvent())
    if op == "close":
        return proto.receive_client_event(SessionCloseEvent())
    if op == "open_refused":
        proto.open_refused()
        return None
    if op == "done":
        return proto.response_finished(arg)
    assert op == "server_close"
    return proto.server_close(arg)


@settings(max_examples=300, deadline=None)
@given(st.lists(machine_ops, max_size=40))
def test_random_input_sequences(ops: list[tuple[str, Any]]) -> None:
    proto = SessionProtocol(LIMITS)
    indices: list[int] = []
    outstanding = 0  # accepted chunks without their response.done
    for op, arg in ops:
        before = proto.state
        try:
            result = _step(proto, op, arg)
        except RealtimeError as exc:
            encode_server_event(error_event(exc))
            if not (op == "binary" and before is State.AWAITING_BINARY):
                assert proto.state is before, "refusals leave the state unchanged"
            continue
        if isinstance(result, SubmitFrame):
            indices.append(result.frame.frame_index)
            outstanding += 1
        if op == "done":
            outstanding -= 1
        if isinstance(result, CloseSession):
            assert (result.in_flight is not None) == (outstanding == 1)

        # invariants after every accepted input
        assert 0 <= outstanding <= 1, "at most one chunk in flight"
        assert (proto.in_flight is not None) == (outstanding == 1)
        assert (proto.pending_frame is not None) == (proto.state is State.AWAITING_BINARY)
        if proto.state is State.AWAITING_RESPONSE:
            assert proto.in_flight is not None
        if proto.state in (State.CONNECTED, State.IDLE, State.AWAITING_BINARY):
            assert proto.in_flight is None
        assert (proto.config is None) == (proto.state is State.CONNECTED) or (
            proto.state is State.CLOSED
        )
    assert indices == list(range(len(indices))), "frame_index strictly increasing from 0"
    assert proto.frames_total == len(indices)
    # the reply of an accepted chunk can always still be finished: response.done is always sent
    if outstanding:
        done = proto.response_finished("cancelled")
        assert done.frame_index == indices[-1]
    assert sum(proto.responses.values()) == len(indices)
