"""Unit tests of vllm_realtime_protocol.state: the whole transition table, pair by pair, and the flows."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from strategies import JPEG, MP4, PNG, WEBM, WEBP, b64

from vllm_realtime_protocol import (
    AwaitBinary,
    BinaryUnexpected,
    CancelResponse,
    ChunkInFlight,
    CloseSession,
    FrameAppendEvent,
    FrameTooLarge,
    Input,
    InternalError,
    InvalidEvent,
    InvalidRequestError,
    Limits,
    NoResponseInFlight,
    OpenSession,
    RealtimeError,
    ResponseCancelEvent,
    ResumableConfig,
    ResumeSession,
    SamplingConfig,
    SessionAlreadyOpen,
    SessionClosed,
    SessionCloseEvent,
    SessionNotOpen,
    SessionOpenEvent,
    SessionProtocol,
    SessionResumeEvent,
    SessionUpdateEvent,
    State,
    SubmitFrame,
    UndecodableFrame,
    UpdateSession,
    Usage,
)
from vllm_realtime_protocol.state import REFUSALS, TRANSITIONS

LIMITS = Limits(
    server_version="0.1.0",
    model="test-model",
    max_frame_bytes=1000,
    max_tokens_cap=128,
    max_resume_grace_s=30.0,
)
RESUMABLE = ResumableConfig(grace_s=10.0)


def new() -> SessionProtocol:
    return SessionProtocol(LIMITS, session_id="sess_test")


def opened(**config: Any) -> SessionProtocol:
    proto = new()
    proto.receive_client_event(SessionOpenEvent.model_validate(config))
    return proto


def submit(proto: SessionProtocol, **payload: Any) -> SubmitFrame:
    action = proto.receive_client_event(
        FrameAppendEvent.model_validate(payload or {"image": b64(JPEG)})
    )
    assert isinstance(action, SubmitFrame)
    return action


# Fixtures that put a fresh machine in each state, satisfying the table's guards:
# IDLE has accepted no chunk yet (OPEN_REFUSED allowed); CLOSED has a reply draining; every
# open session is resumable (DETACH allowed).
def _in_state(state: State) -> SessionProtocol:
    proto = new()
    if state is State.CONNECTED:
        return proto
    proto.receive_client_event(SessionOpenEvent(resumable=RESUMABLE))
    if state is State.IDLE:
        return proto
    if state is State.PARKED:
        proto.detach()
        return proto
    if state is State.AWAITING_BINARY:
        proto.receive_client_event(FrameAppendEvent(binary=True))
        return proto
    submit(proto)
    if state is State.CLOSED:
        proto.receive_client_event(SessionCloseEvent())
    if state is State.PARKED_AWAITING_RESPONSE:
        proto.detach()
    return proto


def _apply(proto: SessionProtocol, inp: Input) -> object:
    steps: dict[Input, Callable[[], object]] = {
        Input.SESSION_OPEN: lambda: proto.receive_client_event(SessionOpenEvent(event_id="ev")),
        Input.FRAME_APPEND: lambda: proto.receive_client_event(
            FrameAppendEvent(image=b64(JPEG), event_id="ev")
        ),
        Input.FRAME_ANNOUNCE: lambda: proto.receive_client_event(
            FrameAppendEvent(binary=True, event_id="ev")
        ),
        Input.BINARY: lambda: proto.receive_binary(JPEG),
        Input.RESPONSE_CANCEL: lambda: proto.receive_client_event(
            ResponseCancelEvent(event_id="ev")
        ),
        Input.SESSION_CLOSE: lambda: proto.receive_client_event(SessionCloseEvent(event_id="ev")),
        Input.OPEN_REFUSED: proto.open_refused,
        Input.RESPONSE_DONE: lambda: proto.response_finished("completed"),
        Input.ENGINE_ERROR: lambda: proto.server_close("engine_error"),
        Input.DISCONNECT: lambda: proto.server_close("disconnect"),
        Input.IDLE_TIMEOUT: lambda: proto.server_close("idle_timeout"),
        Input.SERVER_SHUTDOWN: lambda: proto.server_close("server_shutdown"),
        Input.FATAL_ERROR: lambda: proto.server_close("error"),
        Input.SESSION_RESUME: lambda: proto.receive_client_event(
            SessionResumeEvent(session_id="sess_other", resume_token="tok", event_id="ev")
        ),
        Input.SESSION_UPDATE: lambda: proto.receive_client_event(
            SessionUpdateEvent(sampling=SamplingConfig(temperature=0.5), event_id="ev")
        ),
        Input.DETACH: proto.detach,
        Input.RESUMED: lambda: proto.resumed("tok-2"),
        Input.EXPIRE: lambda: proto.server_close("expired"),
    }
    return steps[inp]()


ALL_PAIRS = list(itertools.product(State, Input))
_CLIENT_INPUTS = {
    Input.SESSION_OPEN,
    Input.FRAME_APPEND,
    Input.FRAME_ANNOUNCE,
    Input.BINARY,
    Input.RESPONSE_CANCEL,
    Input.SESSION_CLOSE,
    Input.SESSION_RESUME,
    Input.SESSION_UPDATE,
}


def _pair_id(pair: tuple[State, Input]) -> str:
    return f"{pair[0].name}-{pair[1].name}"


def test_tables_partition_every_pair() -> None:
    assert set(TRANSITIONS).isdisjoint(REFUSALS)
    assert set(TRANSITIONS) | set(REFUSALS) == set(ALL_PAIRS)


@pytest.mark.parametrize("pair", sorted(TRANSITIONS, key=_pair_id), ids=_pair_id)
def test_transition(pair: tuple[State, Input]) -> None:
    state, inp = pair
    proto = _in_state(state)
    assert proto.state is state
    _apply(proto, inp)
    assert proto.state is TRANSITIONS[pair]


@pytest.mark.parametrize("pair", sorted(REFUSALS, key=_pair_id), ids=_pair_id)
def test_refusal(pair: tuple[State, Input]) -> None:
    state, inp = pair
    proto = _in_state(state)
    before = (proto.frames_total, proto.in_flight, proto.pending_frame, proto.config)
    error = REFUSALS[pair]
    with pytest.raises(error) as info:
        _apply(proto, inp)
    assert type(info.value) is error
    assert info.value.code == error.code
    assert proto.state is state, "a refusal leaves the state unchanged"
    assert (proto.frames_total, proto.in_flight, proto.pending_frame, proto.config) == before
    if inp in _CLIENT_INPUTS and inp is not Input.BINARY:
        assert info.value.event_id == "ev", "the refusal answers the client's event"


# Every refused pair with its documented error code, spelled out once more.
EXPECTED_REFUSAL_CODES = {
    "CONNECTED": {
        "FRAME_APPEND": "session_not_open",
        "FRAME_ANNOUNCE": "session_not_open",
        "BINARY": "binary_unexpected",
        "RESPONSE_CANCEL": "session_not_open",
        "SESSION_UPDATE": "session_not_open",
        "OPEN_REFUSED": "internal_error",
        "RESPONSE_DONE": "internal_error",
        "DETACH": "internal_error",
        "RESUMED": "internal_error",
        "EXPIRE": "internal_error",
    },
    "IDLE": {
        "SESSION_OPEN": "session_already_open",
        "BINARY": "binary_unexpected",
        "RESPONSE_CANCEL": "no_response_in_flight",
        "RESPONSE_DONE": "internal_error",
        "SESSION_RESUME": "session_already_open",
        "RESUMED": "internal_error",
        "EXPIRE": "internal_error",
    },
    "AWAITING_BINARY": {
        "SESSION_OPEN": "session_already_open",
        "FRAME_APPEND": "chunk_in_flight",
        "FRAME_ANNOUNCE": "chunk_in_flight",
        "RESPONSE_CANCEL": "no_response_in_flight",
        "OPEN_REFUSED": "internal_error",
        "RESPONSE_DONE": "internal_error",
        "SESSION_RESUME": "session_already_open",
        "RESUMED": "internal_error",
        "EXPIRE": "internal_error",
    },
    "AWAITING_RESPONSE": {
        "SESSION_OPEN": "session_already_open",
        "FRAME_APPEND": "chunk_in_flight",
        "FRAME_ANNOUNCE": "chunk_in_flight",
        "BINARY": "binary_unexpected",
        "OPEN_REFUSED": "internal_error",
        "SESSION_RESUME": "session_already_open",
        "RESUMED": "internal_error",
        "EXPIRE": "internal_error",
    },
    "CLOSED": {
        "SESSION_OPEN": "session_closed",
        "FRAME_APPEND": "session_closed",
        "FRAME_ANNOUNCE": "session_closed",
        "BINARY": "session_closed",
        "RESPONSE_CANCEL": "session_closed",
        "SESSION_CLOSE": "session_closed",
        "OPEN_REFUSED": "internal_error",
        "SESSION_RESUME": "session_closed",
        "SESSION_UPDATE": "session_closed",
        "DETACH": "internal_error",
        "RESUMED": "internal_error",
    },
    # Nothing feeds a parked session client events; its clock is the grace period.
    **{
        parked: {
            name: "internal_error"
            for name in (
                "SESSION_OPEN",
                "FRAME_APPEND",
                "FRAME_ANNOUNCE",
                "BINARY",
                "RESPONSE_CANCEL",
                "SESSION_CLOSE",
                "SESSION_RESUME",
                "SESSION_UPDATE",
                "OPEN_REFUSED",
                "DISCONNECT",
                "IDLE_TIMEOUT",
                "DETACH",
            )
        }
        | ({"RESPONSE_DONE": "internal_error"} if parked == "PARKED" else {})
        for parked in ("PARKED", "PARKED_AWAITING_RESPONSE")
    },
}


def test_refusal_codes_as_documented() -> None:
    got: dict[str, dict[str, str]] = {}
    for (state, inp), error in REFUSALS.items():
        got.setdefault(state.name, {})[inp.name] = error.code
    assert got == EXPECTED_REFUSAL_CODES


# --------------------------------------------------------------------------- guards


def test_open_refused_guard() -> None:
    proto = opened()
    submit(proto)
    proto.response_finished("completed")
    with pytest.raises(InternalError):
        proto.open_refused()
    assert proto.state is State.IDLE


def test_open_refused_allows_retry() -> None:
    proto = opened()
    proto.open_refused()
    assert (proto.state, proto.config) == (State.CONNECTED, None)
    assert isinstance(proto.receive_client_event(SessionOpenEvent()), OpenSession)


def test_response_done_in_closed_needs_a_draining_reply() -> None:
    proto = opened()
    proto.receive_client_event(SessionCloseEvent())
    with pytest.raises(InternalError):
        proto.response_finished("cancelled")


# --------------------------------------------------------------------------- flows


def test_greeting() -> None:
    ev = new().greeting()
    assert (ev.type, ev.session_id, ev.limits) == ("session.created", "sess_test", LIMITS)
    assert SessionProtocol(LIMITS).session_id.startswith("sess_")


def test_open_resolves_config() -> None:
    proto = new()
    action = proto.receive_client_event(
        SessionOpenEvent.model_validate({"sampling": {"max_tokens": 4096, "seed": 3}})
    )
    assert isinstance(action, OpenSession)
    assert action.config.sampling.max_tokens == 128  # capped by limits.max_tokens_cap
    assert action.config.sampling.seed == 3
    assert action.config.model == "test-model"
    assert action.event.config == action.config == proto.config
    assert (action.event.session_id, action.event.limits) == ("sess_test", LIMITS)


def test_open_refuses_other_model() -> None:
    proto = new()
    with pytest.raises(InvalidEvent, match="other") as info:
        proto.receive_client_event(SessionOpenEvent(model="other", event_id="o1"))
    assert info.value.event_id == "o1"
    assert proto.state is State.CONNECTED
    proto.receive_client_event(SessionOpenEvent(model="test-model"))
    assert proto.state is State.IDLE


def test_frame_flow_and_indices() -> None:
    proto = opened()
    for i in range(3):
        action = submit(proto, image=b64(PNG), frame_id=f"f{i}", prompt="p", timestamp=i / 10)
        frame = action.frame
        assert (frame.frame_index, frame.frame_id, frame.kind, frame.media_format) == (
            i,
            f"f{i}",
            "image",
            "png",
        )
        assert (frame.data, frame.prompt, frame.timestamp) == (PNG, "p", i / 10)
        assert (action.ack.frame_index, action.ack.frame_id, action.ack.bytes) == (i, f"f{i}", 24)
        assert proto.in_flight == frame
        done = proto.response_finished(
            "completed", text="ok", usage=Usage(prompt_tokens=5, completion_tokens=1)
        )
        assert (done.frame_index, done.frame_id, done.status, done.text) == (
            i,
            f"f{i}",
            "completed",
            "ok",
        )
        assert done.usage.prompt_tokens == 5
        assert proto.state is State.IDLE and proto.in_flight is None
    assert proto.frames_total == 3
    assert proto.responses == {"completed": 3}
    assert "data=" not in repr(frame), "payload bytes stay out of logs"


def test_video_frame() -> None:
    proto = opened()
    frame = submit(proto, video=b64(WEBM)).frame
    assert (frame.kind, frame.media_format) == ("video", "webm")


def test_text_session() -> None:
    proto = opened(modality="text")
    action = submit(proto, text="héllo")
    assert (action.frame.kind, action.frame.text, action.frame.data) == (
        "text",
        "héllo",
        "héllo".encode(),
    )
    assert action.ack.bytes == 6
    assert action.frame.media_format is None


@pytest.mark.parametrize(
    ("modality", "payload"),
    [
        ("text", {"image": b64(JPEG)}),
        ("text", {"video": b64(MP4)}),
        ("text", {"binary": True}),
    ],
)
def test_modality_mismatch(modality: str, payload: dict[str, Any]) -> None:
    proto = opened(modality=modality)
    with pytest.raises(InvalidEvent, match=f"{modality} session"):
        proto.receive_client_event(FrameAppendEvent.model_validate(payload))
    assert proto.state is State.IDLE


def test_video_session_takes_a_question() -> None:
    # Issue #19: text in a video session is a question about the window, answered like any chunk.
    proto = opened(modality="video")
    action = proto.receive_client_event(
        FrameAppendEvent.model_validate({"text": "What is in view?", "frame_id": "q"})
    )
    assert isinstance(action, SubmitFrame)
    assert action.frame.kind == "text" and action.frame.text == "What is in view?"
    assert action.frame.reply is True
    assert proto.state is State.AWAITING_RESPONSE


def test_ingested_chunk_finishes_as_ingested() -> None:
    proto = opened(modality="video")
    action = proto.receive_client_event(
        FrameAppendEvent.model_validate({"image": b64(JPEG), "reply": False})
    )
    assert isinstance(action, SubmitFrame) and action.frame.reply is False
    # One chunk in flight, as for an answered chunk.
    with pytest.raises(ChunkInFlight):
        proto.receive_client_event(FrameAppendEvent.model_validate({"image": b64(JPEG)}))
    done = proto.response_finished("ingested")
    assert done.status == "ingested" and done.text == ""
    assert proto.state is State.IDLE and proto.responses == {"ingested": 1}


def test_chunk_response_format_reaches_the_frame() -> None:
    proto = opened(modality="text")
    fmt = {"type": "json_schema", "json_schema": {"name": "e", "schema": {"type": "object"}}}
    action = proto.receive_client_event(
        FrameAppendEvent.model_validate({"text": "hi", "response_format": fmt})
    )
    assert isinstance(action, SubmitFrame)
    assert action.frame.response_format is not None
    assert action.frame.response_format.type == "json_schema"


@pytest.mark.parametrize(
    ("config", "payload", "error"),
    [
        ({}, {"image": b64(b"GIF89a....")}, UndecodableFrame),
        ({}, {"image": b64(MP4)}, UndecodableFrame),
        ({}, {"video": b64(JPEG)}, UndecodableFrame),
        ({}, {"image": "%%%"}, UndecodableFrame),
        ({"frame_format": "jpeg"}, {"image": b64(PNG)}, UndecodableFrame),
        ({"frame_format": "webp"}, {"image": b64(JPEG)}, UndecodableFrame),
        ({}, {"image": b64(JPEG * 100)}, FrameTooLarge),
        ({"modality": "text"}, {"text": "x" * 1001}, FrameTooLarge),
    ],
)
def test_refused_frames_leave_idle(
    config: dict[str, Any], payload: dict[str, Any], error: type[RealtimeError]
) -> None:
    proto = opened(**config)
    with pytest.raises(error) as info:
        proto.receive_client_event(FrameAppendEvent.model_validate({**payload, "event_id": "bad"}))
    assert info.value.session_survives
    assert info.value.event_id == "bad"
    assert (proto.state, proto.frames_total, proto.in_flight) == (State.IDLE, 0, None)
    good = {
        "jpeg": {"image": b64(JPEG)},
        "webp": {"image": b64(WEBP)},
        "text": {"text": "fine"},
    }[config.get("frame_format") or config.get("modality") or "jpeg"]
    assert submit(proto, **good).frame.frame_index == 0, "a refused frame uses no index"


def test_frame_format_accepts_match() -> None:
    proto = opened(frame_format="webp")
    assert submit(proto, image=b64(WEBP)).frame.media_format == "webp"


def test_binary_flow() -> None:
    proto = opened()
    action = proto.receive_client_event(FrameAppendEvent(binary=True, frame_id="b1", prompt="q"))
    assert action == AwaitBinary(frame_id="b1")
    assert proto.state is State.AWAITING_BINARY
    assert proto.pending_frame is not None
    submitted = proto.receive_binary(MP4)
    assert (submitted.frame.kind, submitted.frame.media_format, submitted.frame.frame_id) == (
        "video",
        "mp4",
        "b1",
    )
    assert (submitted.frame.prompt, submitted.frame.data, submitted.ack.bytes) == (
        "q",
        MP4,
        len(MP4),
    )
    assert proto.pending_frame is None and proto.state is State.AWAITING_RESPONSE


@pytest.mark.parametrize(
    ("config", "data", "error"),
    [
        ({}, b"junk", UndecodableFrame),
        ({"frame_format": "png"}, JPEG, UndecodableFrame),
        ({}, JPEG * 100, FrameTooLarge),
    ],
)
def test_refused_binary_consumes_the_announcement(
    config: dict[str, Any], data: bytes, error: type[RealtimeError]
) -> None:
    proto = opened(**config)
    proto.receive_client_event(FrameAppendEvent(binary=True, event_id="ann"))
    with pytest.raises(error) as info:
        proto.receive_binary(data)
    assert info.value.event_id == "ann"
    assert (proto.state, proto.pending_frame, proto.frames_total) == (State.IDLE, None, 0)
    with pytest.raises(BinaryUnexpected):
        proto.receive_binary(JPEG)


def test_cancel_flow() -> None:
    proto = opened()
    submit(proto)
    assert proto.receive_client_event(ResponseCancelEvent()) == CancelResponse(frame_index=0)
    assert proto.cancel_requested
    assert proto.receive_client_event(ResponseCancelEvent()) == CancelResponse(frame_index=0)
    with pytest.raises(ChunkInFlight):
        proto.receive_client_event(FrameAppendEvent(image=b64(JPEG)))
    done = proto.response_finished("cancelled", status_reason="client_cancelled", text="partial")
    assert (done.status, done.status_reason, done.text) == (
        "cancelled",
        "client_cancelled",
        "partial",
    )
    assert not proto.cancel_requested
    assert proto.state is State.IDLE
    with pytest.raises(NoResponseInFlight):
        proto.receive_client_event(ResponseCancelEvent())


def test_cancel_while_awaiting_binary_is_refused() -> None:
    proto = opened()
    proto.receive_client_event(FrameAppendEvent(binary=True))
    with pytest.raises(NoResponseInFlight):
        proto.receive_client_event(ResponseCancelEvent())
    assert proto.state is State.AWAITING_BINARY


@pytest.mark.parametrize(
    "reason", ["engine_error", "disconnect", "idle_timeout", "server_shutdown", "error"]
)
def test_close_drains_the_reply_in_flight(reason: Any) -> None:
    proto = opened()
    frame = submit(proto).frame
    action = proto.server_close(reason)
    assert isinstance(action, CloseSession)
    assert (action.reason, action.in_flight) == (reason, frame)
    assert (action.event.reason, action.event.frames_total, action.event.session_id) == (
        reason,
        1,
        "sess_test",
    )
    assert proto.state is State.CLOSED and proto.close_reason == reason
    done = proto.response_finished("failed" if reason == "engine_error" else "cancelled")
    assert done.frame_index == 0
    assert proto.in_flight is None
    with pytest.raises(InternalError):
        proto.response_finished("cancelled")  # exactly one response.done per chunk
    assert proto.server_close("disconnect") is None  # idempotent once closed
    assert proto.close_reason == reason


def test_client_close() -> None:
    proto = opened()
    action = proto.receive_client_event(SessionCloseEvent())
    assert isinstance(action, CloseSession)
    assert (action.reason, action.in_flight, action.event.frames_total) == (
        "client_closed",
        None,
        0,
    )
    with pytest.raises(SessionClosed) as info:
        proto.receive_client_event(SessionCloseEvent())
    assert not info.value.session_survives


def test_close_before_open_and_while_awaiting_binary() -> None:
    proto = new()
    action = proto.receive_client_event(SessionCloseEvent())
    assert isinstance(action, CloseSession) and action.reason == "client_closed"
    proto = opened()
    proto.receive_client_event(FrameAppendEvent(binary=True))
    action = proto.receive_client_event(SessionCloseEvent())
    assert isinstance(action, CloseSession) and action.in_flight is None
    assert proto.pending_frame is None


def test_errors_before_open() -> None:
    proto = new()
    with pytest.raises(SessionNotOpen):
        proto.receive_client_event(FrameAppendEvent(text="x"))
    proto.receive_client_event(SessionOpenEvent())
    with pytest.raises(SessionAlreadyOpen):
        proto.receive_client_event(SessionOpenEvent())


# -- resumption


def test_open_caps_resumable_grace_and_plain_sessions_stay_plain() -> None:
    proto = new()
    action = proto.receive_client_event(SessionOpenEvent(resumable=ResumableConfig(grace_s=600)))
    assert isinstance(action, OpenSession)
    assert action.config.resumable == ResumableConfig(grace_s=30.0)  # LIMITS caps at 30 s
    assert action.event.resume_token is None  # the server fills it in
    assert opened().config is not None and opened().config.resumable is None  # type: ignore[union-attr]
    off = SessionProtocol(LIMITS.model_copy(update={"max_resume_grace_s": 0.0}))
    action = off.receive_client_event(SessionOpenEvent(resumable=RESUMABLE))
    assert isinstance(action, OpenSession) and action.config.resumable is None


def test_detach_needs_a_resumable_session() -> None:
    proto = opened()
    with pytest.raises(InternalError):
        proto.detach()
    assert proto.state is State.IDLE


def test_session_resume_asks_the_server_to_look_up() -> None:
    proto = new()
    action = proto.receive_client_event(
        SessionResumeEvent(session_id="sess_a", resume_token="secret", event_id="r1")
    )
    assert action == ResumeSession("sess_a", "secret", "r1")
    assert proto.state is State.CONNECTED


def test_park_idle_and_resume_continues_frame_indices() -> None:
    proto = _in_state(State.IDLE)
    first = submit(proto)
    proto.response_finished("completed", text="a")
    proto.detach()
    assert proto.state is State.PARKED
    resumed = proto.resumed("tok-2")
    assert proto.state is State.IDLE
    assert resumed.session_id == "sess_test" and resumed.resume_token == "tok-2"
    assert resumed.next_frame_index == first.frame.frame_index + 1 == 1
    assert resumed.missed_response is None and resumed.in_flight_frame_index is None
    assert resumed.config.resumable == RESUMABLE
    assert submit(proto).frame.frame_index == 1


def test_reply_finishing_while_parked_is_handed_over_exactly_once() -> None:
    proto = _in_state(State.IDLE)
    submit(proto, image=b64(JPEG), frame_id="f0")
    proto.detach()
    assert proto.state is State.PARKED_AWAITING_RESPONSE
    done = proto.response_finished("completed", text="the reply")
    assert proto.state is State.PARKED and proto.missed_response == done
    resumed = proto.resumed("tok-2")
    assert resumed.missed_response == done and resumed.missed_response.frame_id == "f0"
    assert resumed.next_frame_index == 1
    # Parked and resumed again: the response.done is not handed over a second time.
    proto.detach()
    assert proto.resumed("tok-3").missed_response is None


def test_resume_while_the_reply_still_runs() -> None:
    proto = _in_state(State.PARKED_AWAITING_RESPONSE)
    resumed = proto.resumed("tok-2")
    assert proto.state is State.AWAITING_RESPONSE
    assert resumed.in_flight_frame_index == 0 and resumed.missed_response is None
    # The reply's response.done then goes to the new connection the usual way.
    assert proto.response_finished("completed").frame_index == 0
    assert proto.state is State.IDLE


def test_parked_awaiting_binary_drops_the_announcement() -> None:
    proto = _in_state(State.AWAITING_BINARY)
    proto.detach()
    assert proto.state is State.PARKED and proto.pending_frame is None
    proto.resumed("tok-2")
    assert proto.state is State.IDLE and proto.frames_total == 0


@pytest.mark.parametrize("state", [State.PARKED, State.PARKED_AWAITING_RESPONSE])
def test_expiry_closes_with_reason_expired(state: State) -> None:
    proto = _in_state(state)
    close = proto.server_close("expired")
    assert isinstance(close, CloseSession)
    assert close.reason == "expired" and close.event.reason == "expired"
    assert proto.state is State.CLOSED
    if state is State.PARKED_AWAITING_RESPONSE:
        # The reply still running is drained like at any close.
        assert close.in_flight is not None
        assert proto.response_finished("cancelled", status_reason="expired").frame_index == 0


def test_session_update_merges_sampling_and_keeps_the_rest() -> None:
    proto = new()
    proto.receive_client_event(
        SessionOpenEvent(sampling=SamplingConfig(max_tokens=16, temperature=0.0, seed=7))
    )
    action = proto.receive_client_event(
        SessionUpdateEvent.model_validate({"sampling": {"temperature": 0.8, "max_tokens": 4096}})
    )
    assert isinstance(action, UpdateSession)
    sampling = action.config.sampling
    # Only the fields sent change; max_tokens is capped as at open; the seed stays.
    assert (sampling.temperature, sampling.seed) == (0.8, 7)
    assert sampling.max_tokens == LIMITS.max_tokens_cap
    assert action.previous.sampling.temperature == 0.0
    assert proto.config == action.config == action.event.config
    assert proto.state is State.IDLE
    proto.update_refused(action.previous)  # the server could not apply it: back as it was
    assert proto.config == action.previous


@pytest.mark.parametrize("field", ["instructions", "retention", "modality", "limits", "resumable"])
def test_session_update_refuses_fixed_settings_naming_them(field: str) -> None:
    proto = new()
    proto.receive_client_event(SessionOpenEvent(instructions="watch"))
    before = proto.config
    values: dict[str, Any] = {
        "instructions": "other",
        "retention": {"window_chunks": 2},
        "modality": "text",
        "limits": {"max_clip_frames": 2},
        "resumable": {"grace_s": 5.0},
    }
    with pytest.raises(InvalidRequestError) as caught:
        proto.receive_client_event(SessionUpdateEvent.model_validate({field: values[field]}))
    assert caught.value.param == field and caught.value.session_survives
    assert proto.config == before and proto.state is State.IDLE
