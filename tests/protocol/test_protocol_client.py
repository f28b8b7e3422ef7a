"""The client's machine (protocol/vllm_realtime_protocol/client.py) against the server's, on the same tables.

A scripted server (the server's SessionProtocol under a few lines that turn its actions into the
events a connection sends) answers random client sends and server happenings. After every step
the two machines agree on the session's state; every send the client refuses locally, the
server refuses with the same error code.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import JPEG, MP4, PNG, WEBM, WEBP, b64

from vllm_realtime_protocol import (
    CloseSession,
    FrameAppendEvent,
    Limits,
    OpenSession,
    RealtimeError,
    ResponseCancelEvent,
    SessionCloseEvent,
    SessionOpenEvent,
    SessionProtocol,
    SessionUpdateEvent,
    State,
    SubmitFrame,
    UpdateSession,
    error_event,
)
from vllm_realtime_protocol.client import ClientProtocol
from vllm_realtime_protocol.errors import CapacityExceeded
from vllm_realtime_protocol.events import ClientEvent, ServerEvent
from vllm_realtime_protocol.tables import REFUSALS, TRANSITIONS, Input, as_data

LIMITS = Limits(server_version="0.1.0", model="test-model", max_frame_bytes=1000)
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class ScriptedServer:
    """The server's machine, and the events a connection sends for its actions."""

    def __init__(self) -> None:
        self.proto = SessionProtocol(LIMITS)
        self.sent: list[ServerEvent] = [self.proto.greeting()]

    def client_event(self, event: ClientEvent, admit: bool = True) -> None:
        self._run(lambda: self.proto.receive_client_event(event), admit)

    def binary(self, data: bytes) -> None:
        self._run(lambda: self.proto.receive_binary(data), True)

    def _run(self, step: Any, admit: bool) -> None:
        try:
            action = step()
        except RealtimeError as exc:
            self.sent.append(error_event(exc))
            if not exc.session_survives:
                self.close("error")
            return
        if isinstance(action, OpenSession):
            if admit:
                self.sent.append(action.event)
            else:  # admission refused it, as the connection does on capacity
                self.proto.open_refused()
                self.sent.append(error_event(CapacityExceeded("no KV capacity")))
        elif isinstance(action, SubmitFrame):
            self.sent.append(action.ack)
        elif isinstance(action, UpdateSession):
            self.sent.append(action.event)
        elif isinstance(action, CloseSession):
            self._finish(action)
        # AwaitBinary, CancelResponse: nothing is sent until the reply ends.

    def reply_done(self, status: Any) -> None:
        if self.proto.state is State.AWAITING_RESPONSE:
            self.sent.append(self.proto.response_finished(status))

    def close(self, reason: Any) -> None:
        action = self.proto.server_close(reason)
        if action is not None:
            self._finish(action)

    def _finish(self, action: CloseSession) -> None:
        if action.in_flight is not None:  # drained
            self.sent.append(self.proto.response_finished("cancelled"))
        self.sent.append(action.event)


payloads = st.one_of(
    st.fixed_dictionaries({"image": st.sampled_from([JPEG, PNG, WEBP, MP4, b"junk"])}),
    st.fixed_dictionaries({"video": st.sampled_from([MP4, WEBM, JPEG])}),
    st.fixed_dictionaries({"text": st.text(min_size=1, max_size=8)}),
    st.just({"binary": True}),
    st.just({"image": JPEG * 100}),  # over the frame limit
)
_open = st.tuples(
    st.just("open"),
    st.fixed_dictionaries(
        {"admit": st.booleans()},
        optional={
            "modality": st.sampled_from(["video", "text"]),
            "frame_format": st.sampled_from(["jpeg", "png", "auto"]),
            "model": st.sampled_from(["test-model", "other-model"]),
        },
    ),
)
_append = st.tuples(st.just("append"), payloads)
_binary = st.tuples(st.just("binary"), st.sampled_from([JPEG, PNG, MP4, b"junk", JPEG * 100]))
_done = st.tuples(st.just("done"), st.sampled_from(["completed", "cancelled", "failed"]))
_ending = st.one_of(  # rarer than the rest: a closed session refuses everything after it
    st.tuples(st.just("close"), st.none()),
    st.tuples(
        st.just("server_close"),
        st.sampled_from(["engine_error", "idle_timeout", "server_shutdown", "error"]),
    ),
)
_by_name: dict[str, st.SearchStrategy[tuple[str, Any]]] = {
    "open": _open,
    "append": _append,
    "binary": _binary,
    "done": _done,
    "cancel": st.tuples(st.just("cancel"), st.none()),
    "update": st.tuples(
        st.just("update"), st.sampled_from([{"frame_format": "png"}, {"modality": "text"}])
    ),
    "ending": _ending,
}
_weights = ["open"] + ["append"] * 4 + ["binary"] * 3 + ["done"] * 3 + ["cancel", "update"]
ops = st.sampled_from([*_weights, "ending"]).flatmap(lambda name: _by_name[name])


def _client_event(op: str, arg: Any) -> ClientEvent:
    if op == "open":
        return SessionOpenEvent.model_validate({k: v for k, v in arg.items() if k != "admit"})
    if op == "append":
        payload = {k: b64(v) if isinstance(v, bytes) else v for k, v in arg.items()}
        return FrameAppendEvent.model_validate(payload)
    if op == "cancel":
        return ResponseCancelEvent()
    if op == "close":
        return SessionCloseEvent()
    assert op == "update"
    return SessionUpdateEvent.model_validate(arg)


def _to_server(server: ScriptedServer, op: str, arg: Any) -> None:
    """What the server does with the client's send ``op``."""
    if op == "binary":
        server.binary(arg)
    else:
        admit = arg.get("admit", True) if op == "open" else True
        server.client_event(_client_event(op, arg), admit=admit)


def _to_client(client: ClientProtocol, op: str, arg: Any) -> None:
    if op == "binary":
        client.send_binary(arg)
    else:
        client.send(_client_event(op, arg))


def _server_refusal(server: ScriptedServer, op: str, arg: Any) -> str:
    before = len(server.sent)
    _to_server(server, op, arg)
    (refusal,) = [e for e in server.sent[before:] if e.type == "error"]
    return refusal.error.code  # type: ignore[union-attr]


# Most sequences start with an admitted session.open, so that the later steps reach the states
# past IDLE instead of being refused in CONNECTED.
_OPENED = ("open", {"admit": True, "modality": "video"})
sequences = st.tuples(st.booleans(), st.lists(ops, min_size=4, max_size=40)).map(
    lambda t: [_OPENED, *t[1]] if t[0] else t[1]
)


@FAST
@given(sequences)
def test_the_client_and_server_machines_never_disagree(steps: list[tuple[str, Any]]) -> None:
    server, client = ScriptedServer(), ClientProtocol()
    delivered = 0

    def deliver() -> None:
        nonlocal delivered
        for event in server.sent[delivered:]:
            client.receive(event)
        delivered = len(server.sent)

    deliver()
    for op, arg in steps:
        if op in ("done", "server_close"):
            if op == "done":
                server.reply_done(arg)
            else:
                server.close(arg)
            deliver()
        else:
            try:
                _to_client(client, op, arg)
            except RealtimeError as exc:
                state = server.proto.state
                assert _server_refusal(server, op, arg) == exc.code, (op, arg, state)
                assert server.proto.state is state and client.state is state
                delivered = len(server.sent)  # never sent: the server's answer is not the client's
                continue
            _to_server(server, op, arg)
            deliver()
        assert client.state is server.proto.state, (op, arg, server.sent[-3:])
        if server.proto.config is not None and client.state is not State.CLOSED:
            assert client.config == server.proto.config
        assert client.next_frame_index == server.proto.frames_total or client.state is State.CLOSED


def test_the_client_reads_the_servers_tables() -> None:
    from vllm_realtime_protocol import client, state

    assert client.TRANSITIONS is state.TRANSITIONS is TRANSITIONS
    assert client.REFUSALS is state.REFUSALS is REFUSALS


def test_the_tables_as_data_cover_every_pair_once_and_are_json() -> None:
    data = json.loads(json.dumps(as_data()))
    pairs = [(s, i) for s, i, _ in data["transitions"] + data["refusals"]]
    assert len(pairs) == len(set(pairs)) == len(State) * len(Input)
    assert ["idle", "frame.append", "awaiting_response"] in data["transitions"]
    assert ["awaiting_response", "frame.append", "chunk_in_flight"] in data["refusals"]


def test_a_chunk_in_flight_is_refused_locally_with_the_servers_code() -> None:
    client = ClientProtocol()
    client.send(SessionOpenEvent(modality="text"))
    client.send(FrameAppendEvent(text="one"))
    try:
        client.send(FrameAppendEvent(text="two", event_id="e2"))
    except RealtimeError as exc:
        assert exc.code == "chunk_in_flight" and exc.event_id == "e2"
    else:
        raise AssertionError("a second chunk in flight was not refused")
    assert client.state is State.AWAITING_RESPONSE


def test_an_update_while_a_chunk_awaits_its_ack_is_answered_in_order() -> None:
    """Two sends unanswered at once: the server answers them in the order sent."""
    from vllm_realtime_protocol import InputAckEvent, SessionUpdatedEvent

    server, client = ScriptedServer(), ClientProtocol()
    for event in server.sent:
        client.receive(event)
    opened = SessionOpenEvent(modality="text", event_id="o")
    chunk = FrameAppendEvent(text="one", event_id="c")
    update = SessionUpdateEvent(frame_format="png", event_id="u")
    for event in (opened, chunk, update):
        client.send(event)
        server.client_event(event)
    assert client.unanswered == (Input.SESSION_OPEN, Input.FRAME_APPEND, Input.SESSION_UPDATE)
    acks = [e for e in server.sent if isinstance(e, InputAckEvent | SessionUpdatedEvent)]
    assert len(acks) == 2
    for event in server.sent[1:]:
        client.receive(event)  # no InternalError: the ack goes to the chunk, updated to the update
    assert client.unanswered == ()
    assert client.state is server.proto.state is State.AWAITING_RESPONSE
    assert client.in_flight_frame_index == 0 and client.next_frame_index == 1
    assert client.config == server.proto.config


def test_a_refused_chunk_before_an_unanswered_update_steps_the_update_again() -> None:
    client = ClientProtocol()
    client.send(SessionOpenEvent(modality="text", event_id="o"))
    client.receive(ScriptedServer().sent[0])
    client.send(FrameAppendEvent(text="one", event_id="c"))
    client.send(SessionUpdateEvent(frame_format="png", event_id="u"))
    refusal = error_event(CapacityExceeded("over the chunk budget", event_id="c"))
    client.receive(refusal)
    assert client.state is State.IDLE
    assert client.unanswered == (Input.SESSION_OPEN, Input.SESSION_UPDATE)
    # A late error echoing no unanswered send (a cancel's) undoes nothing.
    client.receive(error_event(CapacityExceeded("late", event_id="x")))
    assert client.state is State.IDLE


def test_a_lost_connection_parks_a_resumable_session_and_ends_any_other() -> None:
    from vllm_realtime_protocol import ResumableConfig, SessionConfig

    for resumable, idle, in_flight in (
        (True, State.PARKED, State.PARKED_AWAITING_RESPONSE),
        (False, State.CLOSED, State.CLOSED),
    ):
        for chunk, expected in ((False, idle), (True, in_flight)):
            client = ClientProtocol()
            client.send(SessionOpenEvent(modality="text"))
            client.config = SessionConfig(
                modality="text", resumable=ResumableConfig(grace_s=5) if resumable else None
            )
            if chunk:
                client.send(FrameAppendEvent(text="one"))
            client.connection_lost()
            assert client.state is expected, (resumable, chunk)
            assert client.busy is (expected is State.PARKED_AWAITING_RESPONSE)
            client.connection_lost()  # twice: nothing more happens
            assert client.state is expected
    never_opened = ClientProtocol()
    never_opened.connection_lost()
    assert never_opened.state is State.CLOSED
