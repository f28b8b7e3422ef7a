"""The SDK's turn state is the protocol's machine: the real SDK over a real WebSocket server
that plays scripted event sequences (tests/clients/scripted_server.py, no engine), with every
step of the SDK's ClientProtocol checked against the transition tables (tables.py) as it
happens, and every transition a client can take taken at least once.

The SDK's machines are recorded by a subclass of ClientProtocol put where the SDK makes its
machines (session.py, and recovery.py for a new connection's), so each send, each received
event and each lost connection is checked against the table the moment the SDK's machine
takes it: a send moves to TRANSITIONS[(state, input)]; a local refusal raises REFUSALS'
code and changes nothing; a server event moves by its input (response.done, a fatal error,
session.closed by its reason, session.resumed from the parked state it names, a capacity
refusal of an open), or undoes the send it refuses; a lost connection parks a resumable
session (detach) and ends any other (disconnect).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from vllm_realtime_client import ConnectionLost, RealtimeSession, connect
from vllm_realtime_client import recovery as sdk_recovery
from vllm_realtime_client import session as sdk_session

from tests.clients.scripted_server import Peer, ack, closed, done, refusal, resumed, scripted_server
from vllm_realtime_protocol import (
    CapacityExceeded,
    ContextExceeded,
    FrameAppendEvent,
    RealtimeError,
    ResponseCancelEvent,
    ResponseCreatedEvent,
    ResponseTextDeltaEvent,
    ServerDrainingEvent,
    SessionCloseEvent,
    SessionConfig,
    SessionOpenEvent,
    SessionResumeEvent,
    SessionUpdatedEvent,
    SessionUpdateEvent,
    VllmRealtimeError,
)
from vllm_realtime_protocol.client import ClientProtocol
from vllm_realtime_protocol.events import (
    ClientEvent,
    ErrorEvent,
    ResponseDoneEvent,
    ServerEvent,
    SessionClosedEvent,
    SessionResumedEvent,
)
from vllm_realtime_protocol.state import classify
from vllm_realtime_protocol.tables import (
    REFUSALS,
    REFUSED_PAYLOAD_STATE,
    TRANSITIONS,
    Input,
    State,
)

JPEG = b"\xff\xd8\xff\xe0" + b"x" * 96 + b"\xff\xd9"
S, In = State, Input
LIVE = (S.IDLE, S.AWAITING_BINARY, S.AWAITING_RESPONSE)
PARKED = (S.PARKED, S.PARKED_AWAITING_RESPONSE)
CLOSE_INPUTS = {
    "engine_error": In.ENGINE_ERROR,
    "idle_timeout": In.IDLE_TIMEOUT,
    "server_shutdown": In.SERVER_SHUTDOWN,
    "error": In.FATAL_ERROR,
    "disconnect": In.DISCONNECT,
}


def client_side(pair: tuple[State, Input]) -> bool:
    """Whether a client's machine can take this transition of the tables."""
    state, inp = pair
    if inp is In.EXPIRE:
        return False  # a parked session's grace period runs out on the server, no client there
    if state in PARKED:
        # A parked session has no connection: only the resume that takes it over reaches a
        # client (session.resumed names the parked state, by in_flight_frame_index).
        return inp is In.RESUMED
    if state is S.AWAITING_BINARY:
        # The SDK sends a payload right after its announcement, under one send lock: nothing it
        # sends falls between, and a server event read between the two sends cannot be
        # scripted (it depends on the socket's buffering, not on the order of events).
        return inp is In.BINARY
    return True


CLIENT_TRANSITIONS = {pair for pair in TRANSITIONS if client_side(pair)}


@dataclass(frozen=True)
class Step:
    machine: int
    what: str  # send, refused, receive, lost
    pair: tuple[State, Input] | None  # the table's pair it took; None: no table move
    before: State
    after: State
    expected: State | None  # by the tables; None: the tables allow no such step
    note: str

    @property
    def ok(self) -> bool:
        return self.after is self.expected


class Recording(ClientProtocol):
    """The SDK's machine, each step checked against the tables as it is taken."""

    steps: ClassVar[list[Step]] = []
    numbers: ClassVar[itertools.count[int]] = itertools.count(1)

    def __init__(self) -> None:
        super().__init__()
        self.number = next(self.numbers)

    def _log(self, what: str, pair: Any, before: State, expected: State | None, note: str) -> None:
        self.steps.append(Step(self.number, what, pair, before, self.state, expected, note))

    def send(self, event: ClientEvent) -> ClientEvent:
        self._checked_send(classify(event), lambda: super(Recording, self).send(event))
        return event

    def send_binary(self, data: bytes) -> bytes:
        self._checked_send(In.BINARY, lambda: super(Recording, self).send_binary(data))
        return data

    def _checked_send(self, inp: Input, step: Callable[[], object]) -> None:
        before = self.state
        try:
            step()
        except RealtimeError as exc:
            refused = REFUSALS.get((before, inp))
            expected = before if refused is not None and refused.code == exc.code else None
            self._log("refused", None, before, expected, f"{inp.value}: {exc.code}")
            raise
        self._log("send", (before, inp), before, TRANSITIONS.get((before, inp)), inp.value)

    def receive(self, event: ServerEvent) -> None:
        before, pending = self.state, list(self._unanswered)
        try:
            super().receive(event)
        finally:
            pair, expected = _by_the_tables(before, pending, event)
            self._log("receive", pair, before, expected, _describe(event))

    def connection_lost(self) -> None:
        before = self.state
        super().connection_lost()
        resumable = self.config is not None and self.config.resumable is not None
        pair = (before, In.DETACH if resumable and before in LIVE else In.DISCONNECT)
        if pair in TRANSITIONS:
            self._log("lost", pair, before, TRANSITIONS[pair], pair[1].value)
        else:  # a parked machine: its connection is already gone
            self._log("lost", None, before, before if pair in REFUSALS else None, pair[1].value)


def _describe(event: ServerEvent) -> str:
    if isinstance(event, SessionClosedEvent):
        return f"session.closed({event.reason})"
    if isinstance(event, ErrorEvent):
        return f"error({event.error.code})"
    return event.type


def _by_the_tables(
    before: State, pending: list[Any], event: ServerEvent
) -> tuple[tuple[State, Input] | None, State | None]:
    """The table pair a server event is, and the state the tables give after it."""
    pair: tuple[State, Input] | None = None
    if isinstance(event, ResponseDoneEvent):
        pair = (before, In.RESPONSE_DONE)
    elif isinstance(event, SessionClosedEvent):
        if event.reason == "client_closed":  # the answer to the client's session.close
            return None, S.CLOSED if before is S.CLOSED else None
        pair = (before, CLOSE_INPUTS[event.reason])
    elif isinstance(event, SessionResumedEvent):
        if before is not S.CONNECTED:
            return None, None
        parked = S.PARKED if event.in_flight_frame_index is None else S.PARKED_AWAITING_RESPONSE
        pair = (parked, In.RESUMED)
    elif isinstance(event, ErrorEvent):
        if not event.error.session_survives:
            pair = (before, In.FATAL_ERROR)
        else:
            refused = next((p for p in pending if p.event_id == event.error.event_id), None)
            if refused is None:
                return None, before
            if refused.input is In.SESSION_OPEN and event.error.code == CapacityExceeded.code:
                pair = (before, In.OPEN_REFUSED)
            elif TRANSITIONS.get((refused.before, refused.input), refused.before) is refused.before:
                return None, before  # it moved nothing, so nothing is undone
            else:  # a refusal no table foresees: back to before the refused send
                state = REFUSED_PAYLOAD_STATE.get(refused.input, refused.before)
                for later in pending[pending.index(refused) + 1 :]:
                    state = TRANSITIONS.get((state, later.input), state)
                return None, state
    if pair is None:
        return None, before
    return pair, TRANSITIONS.get(pair)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    monkeypatch.setattr(sdk_session, "ClientProtocol", Recording)
    monkeypatch.setattr(sdk_recovery, "ClientProtocol", Recording)
    Recording.steps = []
    return Recording.steps


def _violations(steps: list[Step]) -> list[Step]:
    return [step for step in steps if not step.ok]


async def _session(url: str) -> RealtimeSession:
    return await connect(url, timeout=5.0, close_timeout=2.0, max_retries=4, retry_backoff=0.01)


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def _ended(session: RealtimeSession) -> None:
    async def drain() -> None:
        async for _ in session.events():
            pass

    await asyncio.wait_for(drain(), 5.0)


def _updated(config: SessionConfig, update: SessionUpdateEvent) -> SessionUpdatedEvent:
    changed = config.model_copy(update={"frame_format": update.frame_format})
    return SessionUpdatedEvent(session_id="sess_scripted", config=changed)


# ------------------------------------------------------------------ the scenarios

Scenario = tuple[
    list[Callable[[Peer], Awaitable[None]]], Callable[[RealtimeSession], Awaitable[None]]
]


def turns() -> Scenario:
    """A text turn, a binary image, updates (one while a chunk awaits its ack), a cancel, and a
    close while a reply runs (the reply drains)."""

    async def server(peer: Peer) -> None:
        await peer.greet()
        config = SessionConfig(
            **(await peer.open()).model_dump(include=set(SessionConfig.model_fields))
        )
        await peer.expect(FrameAppendEvent)
        await peer.send(ack(0))
        await peer.reply(0, "a", "b")
        announced = await peer.expect(FrameAppendEvent)
        assert announced.binary
        await peer.binary()
        await peer.send(ack(1))
        await peer.reply(1, "image")
        await peer.send(_updated(config, await peer.expect(SessionUpdateEvent)))
        await peer.expect(FrameAppendEvent)
        update = await peer.expect(SessionUpdateEvent)  # sent before the chunk's input.ack
        await peer.send(ack(2), _updated(config, update), ResponseCreatedEvent(frame_index=2))
        await peer.send(ResponseTextDeltaEvent(frame_index=2, delta="slow"))
        await peer.expect(ResponseCancelEvent)
        await peer.send(done(2, "slow", "cancelled"))
        await peer.expect(FrameAppendEvent)
        await peer.send(ack(3))
        await peer.expect(SessionCloseEvent)
        await peer.send(done(3, "", "cancelled"), closed("client_closed", 4))
        await peer.end()

    async def client(session: RealtimeSession) -> None:
        await session.open(modality="video")
        assert (await session.stream("hello").result()).text == "ab"
        assert (await session.stream(JPEG).result()).text == "image"
        assert (await session.update(frame_format="png")).config.frame_format == "png"
        reply = asyncio.create_task(session.stream("slow").result())
        await _until(lambda: session.protocol.state is S.AWAITING_RESPONSE, "the chunk sent")
        assert session.protocol.unanswered == (In.FRAME_APPEND,)
        updated = await session.update(frame_format="jpeg")
        assert updated.config.frame_format == "jpeg"
        cancelled = await session.cancel()
        assert cancelled is not None and cancelled.status == "cancelled"
        assert (await reply).status == "cancelled"
        assert not session.errors and session.protocol.next_frame_index == 3
        last = asyncio.create_task(session.stream("drained").result())
        await _until(lambda: session.protocol.in_flight_frame_index == 3, "the ack of chunk 3")
        await session.close()
        assert (await last).status == "cancelled"
        assert session.closed is not None and session.closed.reason == "client_closed"

    return [server], client


def close_idle() -> Scenario:
    async def server(peer: Peer) -> None:
        await peer.greet()
        await peer.open()
        await peer.expect(SessionCloseEvent)
        await peer.closed("client_closed")
        await peer.end()

    async def client(session: RealtimeSession) -> None:
        await session.open(modality="text")
        await session.close()

    return [server], client


def close_before_open() -> Scenario:
    async def server(peer: Peer) -> None:
        await peer.greet()
        await peer.expect(SessionCloseEvent)
        await peer.closed("client_closed")
        await peer.end()

    async def client(session: RealtimeSession) -> None:
        await session.close()

    return [server], client


def capacity() -> Scenario:
    """Admission refuses the first open (the connection stays usable); the second is let in."""

    async def server(peer: Peer) -> None:
        await peer.greet()
        first = await peer.expect(SessionOpenEvent)
        await peer.send(refusal(CapacityExceeded("full", event_id=first.event_id)))
        await peer.open()
        await peer.expect(SessionCloseEvent)
        await peer.closed("client_closed")
        await peer.end()

    async def client(session: RealtimeSession) -> None:
        with pytest.raises(CapacityExceeded):
            await session.open(modality="text")
        assert session.protocol.state is S.CONNECTED
        await session.open(modality="text")
        await session.close()

    return [server], client


async def _closer(peer: Peer, reason: str, in_flight: int | None = None) -> None:
    """The server ends the session for ``reason``; a reply in flight is dropped, except that a
    fatal error's drains (as the server does: error, response.done, session.closed)."""
    if reason == "disconnect":
        await peer.drop()
        return
    if reason == "error":
        await peer.send(refusal(ContextExceeded("the context is full")))
        if in_flight is not None:
            await peer.send(done(in_flight, "", "failed"))
    await peer.closed(reason)
    await peer.end()


def server_ends(phase: str, reason: str) -> Scenario:
    """The server ends the session in ``phase``: before the open, idle, while a reply runs, or
    as the client's own close crosses it."""

    async def server(peer: Peer) -> None:
        await peer.greet()
        if phase != "connected":
            await peer.open()
        if phase == "in_flight":
            await peer.expect(FrameAppendEvent)
            await peer.send(ack(0))
            await _closer(peer, reason, in_flight=0)
        elif phase == "closing":
            await peer.expect(SessionCloseEvent)
            await _closer(peer, reason)
        else:
            await _closer(peer, reason)

    async def client(session: RealtimeSession) -> None:
        if phase != "connected":
            await session.open(modality="text")
        if phase == "in_flight" and reason == "error":  # the accepted chunk's reply drains
            assert (await session.stream("q").result()).status == "failed"
        elif phase == "in_flight":
            with pytest.raises((VllmRealtimeError, ConnectionLost)):
                await session.stream("q").result()
        if phase == "closing":
            await session.close()
        await _ended(session)
        assert session.protocol.state is S.CLOSED

    return [server], client


def resumes() -> Scenario:
    """A resilient session dropped while idle, then while a reply runs: resumed both times."""
    config: dict[str, SessionConfig] = {}

    async def first(peer: Peer) -> None:
        await peer.greet()
        opened = await peer.open(resume_token="tok-1")
        config["c"] = SessionConfig(**opened.model_dump(include=set(SessionConfig.model_fields)))
        await peer.drop()

    async def second(peer: Peer) -> None:
        await peer.greet()
        await peer.expect(SessionResumeEvent)
        await peer.send(resumed(config["c"], next_frame_index=0))
        await peer.expect(FrameAppendEvent)
        await peer.send(ack(0), ResponseCreatedEvent(frame_index=0))
        await peer.drop()

    async def third(peer: Peer) -> None:
        await peer.greet()
        await peer.expect(SessionResumeEvent)
        await peer.send(resumed(config["c"], next_frame_index=1, in_flight_frame_index=0))
        await peer.send(ResponseTextDeltaEvent(frame_index=0, delta="rest"), done(0, "rest"))
        await peer.expect(SessionCloseEvent)
        await peer.closed("client_closed", 1)
        await peer.end()

    async def client(session: RealtimeSession) -> None:
        await session.open(modality="text", resumable={"grace_s": 30})
        await _until(lambda: session.resumes == 1, "the first resume")
        reply = await session.stream("q").result()
        assert reply.text == "rest" and session.resumes == 2 and session.chunks_resent == 0
        await session.close()

    return [first, second, third], client


def resends() -> Scenario:
    """#50: the chunk in flight lost with its server (a dead engine's hand-over, then a crashed
    replica) is sent again after the resume the server's next_frame_index asks it for, once."""
    config: dict[str, SessionConfig] = {}

    async def first(peer: Peer) -> None:
        await peer.greet()
        opened = await peer.open(resume_token="tok-1")
        config["c"] = SessionConfig(**opened.model_dump(include=set(SessionConfig.model_fields)))
        await peer.expect(FrameAppendEvent)
        await peer.send(ack(0), ResponseCreatedEvent(frame_index=0))
        await peer.send(ResponseTextDeltaEvent(frame_index=0, delta="lost "))
        # The engine died: no response.done; the store is at the last one.
        await peer.send(ServerDrainingEvent(seconds_left=0, handover=True))
        await peer.closed("server_shutdown")
        await peer.end()

    async def second(peer: Peer) -> None:
        await peer.greet()
        await peer.expect(SessionResumeEvent)
        await peer.send(resumed(config["c"], next_frame_index=0, rebuilt=True))
        again = await peer.expect(FrameAppendEvent)
        assert again.text == "q0"
        await peer.send(ack(0))
        await peer.reply(0, "again")
        await peer.expect(FrameAppendEvent)
        await peer.send(ack(1))
        await peer.drop()  # the replica crashed

    async def third(peer: Peer) -> None:
        await peer.greet()
        await peer.expect(SessionResumeEvent)
        await peer.send(resumed(config["c"], next_frame_index=1, rebuilt=True))
        again = await peer.expect(FrameAppendEvent)
        assert again.text == "q1"
        await peer.send(ack(1))
        await peer.drop()  # and again: the chunk is not sent a third time

    async def fourth(peer: Peer) -> None:
        await peer.greet()
        await peer.expect(SessionResumeEvent)
        await peer.send(resumed(config["c"], next_frame_index=1, rebuilt=True))
        await peer.expect(SessionCloseEvent)
        await peer.closed("client_closed", 1)
        await peer.end()

    async def client(session: RealtimeSession) -> None:
        await session.open(modality="text", resumable={"grace_s": 30})
        reply = await session.stream("q0").result()
        assert reply.text == "again" and session.chunks_resent == 1 and session.resumes == 1
        with pytest.raises(ConnectionLost):
            await session.stream("q1").result()
        assert session.chunks_resent == 2 and session.resumes == 3
        await session.close()

    return [first, second, third, fourth], client


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "turns": turns,
    "close_idle": close_idle,
    "close_before_open": close_before_open,
    "capacity": capacity,
    "resumes": resumes,
    "resends": resends,
    **{
        f"{phase}-{reason}": (lambda p=phase, r=reason: server_ends(p, r))
        for phase in ("connected", "idle", "in_flight", "closing")
        for reason in CLOSE_INPUTS
    },
}


async def _play(name: str) -> None:
    scripts, client = SCENARIOS[name]()
    async with scripted_server(*scripts) as srv:
        session = await _session(srv.url)
        try:
            await client(session)
        finally:
            await session.close()


async def test_every_step_of_the_sdks_machine_is_the_tables_and_every_client_transition_is_taken(
    recorded: list[Step], caplog: pytest.LogCaptureFixture
) -> None:
    exercised: set[tuple[State, Input]] = set()
    for name in SCENARIOS:
        recorded.clear()
        with caplog.at_level(logging.WARNING, logger="vllm_realtime_client"):
            try:
                await asyncio.wait_for(_play(name), 20.0)
            except BaseException as exc:
                raise AssertionError(f"scenario {name}: {exc!r}") from exc
        bad = _violations(recorded)
        assert not bad, (name, bad[0], recorded)
        assert any(step.what == "receive" for step in recorded), name
        exercised |= {step.pair for step in recorded if step.pair is not None}
    assert exercised <= set(TRANSITIONS)
    assert exercised == CLIENT_TRANSITIONS, (
        f"never taken: {sorted((s.value, i.value) for s, i in CLIENT_TRANSITIONS - exercised)}; "
        f"not a client's: {sorted((s.value, i.value) for s, i in exercised - CLIENT_TRANSITIONS)}"
    )
    resent = [r.getMessage() for r in caplog.records if "sending the chunk again" in r.getMessage()]
    assert len(resent) == 2, resent


def test_the_client_transitions_are_the_tables_less_the_servers_own() -> None:
    """What client_side leaves out, by name: a new row of the tables must be decided here."""
    left_out = set(TRANSITIONS) - CLIENT_TRANSITIONS
    assert {p for p in left_out if p[1] is In.EXPIRE} == {
        (S.PARKED, In.EXPIRE),
        (S.PARKED_AWAITING_RESPONSE, In.EXPIRE),
        (S.CLOSED, In.EXPIRE),
    }
    assert {p for p in left_out if p[0] is S.AWAITING_BINARY} == {
        (S.AWAITING_BINARY, i)
        for i in (In.SESSION_CLOSE, In.SESSION_UPDATE, In.DETACH, *CLOSE_INPUTS.values())
    }
    assert len(left_out) == 3 + 8 + 7 and len(CLIENT_TRANSITIONS) == len(TRANSITIONS) - 18


async def test_an_update_while_a_chunk_awaits_its_ack_is_answered_in_order(
    recorded: list[Step],
) -> None:
    """session.update with a chunk's input.ack still due: both are answered, in the order sent,
    and the machine stays the server's (it used to take the ack for the update's answer)."""
    scripts, client = turns()
    async with scripted_server(*scripts) as srv:
        session = await _session(srv.url)
        try:
            await client(session)
        finally:
            await session.close()
        assert not session.errors
    assert not _violations(recorded)
    assert (S.AWAITING_RESPONSE, In.SESSION_UPDATE) in {s.pair for s in recorded}


async def test_calls_made_while_the_session_is_parked_say_so(recorded: list[Step]) -> None:
    """Between a drop and the resume, the machine is parked: an update raises ConnectionLost
    (as a send on the dead socket did), not the tables' internal error; the session goes on."""
    go, asked = asyncio.Event(), asyncio.Event()
    config: dict[str, SessionConfig] = {}

    async def first(peer: Peer) -> None:
        await peer.greet()
        opened = await peer.open(resume_token="tok-1")
        config["c"] = SessionConfig(**opened.model_dump(include=set(SessionConfig.model_fields)))
        await peer.drop()

    async def second(peer: Peer) -> None:
        await peer.greet()
        await peer.expect(SessionResumeEvent)
        asked.set()
        await go.wait()
        await peer.send(resumed(config["c"], next_frame_index=0))
        await peer.expect(SessionCloseEvent)
        await peer.closed("client_closed")
        await peer.end()

    async def play() -> None:
        async with scripted_server(first, second) as srv:
            session = await _session(srv.url)
            try:
                await session.open(modality="text", resumable={"grace_s": 30})
                await asyncio.wait_for(asked.wait(), 5.0)
                assert session.protocol.state is S.PARKED and not session.busy
                with pytest.raises(ConnectionLost, match="being resumed"):
                    await session.update(frame_format="png")
                go.set()
                await _until(lambda: session.resumes == 1, "the resume")
            finally:
                go.set()
                await session.close()
            assert not session.errors

    await asyncio.wait_for(play(), 20.0)
    assert not _violations(recorded)
