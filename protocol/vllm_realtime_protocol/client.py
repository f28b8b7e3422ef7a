"""Sans-I/O state machine of one connection's session, as the client sees it.

Theory of operation
-------------------
The client's machine steps through the server's own tables (``tables.py``): before an event
goes out, :meth:`ClientProtocol.send` looks its (state, input) pair up in :data:`REFUSALS` and
raises the very error the server would send (same class, same ``code``), so a client never
sends what the server must refuse; otherwise it moves to the pair's :data:`TRANSITIONS` entry
at once (the server moves there on receipt). Each server event is then fed to
:meth:`ClientProtocol.receive`, which confirms the move, or applies the server's own
happenings (``response.done``, ``session.closed``, a non-surviving ``error``) by the same
table.

Some refusals no table foresees: the server's checks of a payload, of a setting, of the model
name, admission (``capacity_exceeded``), a resume token. Such an ``error`` (one with
``session_survives``) undoes the send it answers: the one whose ``event_id`` it echoes (an
error with no ``event_id`` answers the oldest unanswered send that had none). The state goes
back to where it was before that send (or to :data:`REFUSED_PAYLOAD_STATE`, for a binary
payload, whose announcement the server consumes), and the sends after it are stepped again
from there. A refused send that moved nothing (``session.update``, ``session.resume``) undoes
nothing: the server's own events may have moved the state since it was sent (a
``response.done``). Several sends may await their answers at once (a ``session.update`` while a
chunk waits for its ``input.ack``): the server answers them in the order they were sent, so
each answer goes to the oldest unanswered send of its kind.

When the connection is gone, :meth:`ClientProtocol.connection_lost` applies what the server
does with it: an open resumable session is parked (``detach``), any other ends (``disconnect``).

The machine does no I/O: a shell (asyncio, sync, browser) serialises what ``send`` returns,
and parses what arrives into ``receive``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from vllm_realtime_protocol.errors import InternalError
from vllm_realtime_protocol.events import (
    ClientEvent,
    ErrorEvent,
    InputAckEvent,
    Limits,
    ResponseDoneEvent,
    ServerEvent,
    SessionClosedEvent,
    SessionConfig,
    SessionCreatedEvent,
    SessionOpenedEvent,
    SessionResumedEvent,
    SessionUpdatedEvent,
)
from vllm_realtime_protocol.state import classify
from vllm_realtime_protocol.tables import (
    REFUSALS,
    REFUSED_PAYLOAD_STATE,
    TRANSITIONS,
    Input,
    State,
)

__all__ = ["ClientProtocol"]


@dataclass(frozen=True, slots=True)
class _Sent:
    """A sent input the server has not answered yet, and the state before it."""

    input: Input
    before: State
    event_id: str | None


class ClientProtocol:
    """The session state of one connection, client side; feed it what is sent and received.

    Typical client loop::

        proto = ClientProtocol()
        proto.receive(parse_server_event(ws.recv()))   # session.created
        ws.send(encode_client_event(proto.send(SessionOpenEvent(modality="text"))))
        proto.receive(parse_server_event(ws.recv()))   # session.opened (or an error)
        ws.send(encode_client_event(proto.send(FrameAppendEvent(text="hi"))))
        ...   # every server event goes through proto.receive
    """

    def __init__(self) -> None:
        self._state = State.CONNECTED
        # Sent inputs awaiting their answers, oldest first (a response.cancel is not one: the
        # reply's response.done answers it, or a no_response_in_flight that changes nothing).
        self._unanswered: deque[_Sent] = deque()
        self.session_id: str | None = None
        """The session's id, from session.created (or session.resumed)."""
        self.limits: Limits | None = None
        """The server's limits, from session.created (or session.resumed)."""
        self.config: SessionConfig | None = None
        """The session's effective settings, as the server last confirmed them."""
        self.next_frame_index = 0
        """The frame_index the server gives the next accepted chunk."""
        self.in_flight_frame_index: int | None = None
        """The accepted chunk whose response.done has not arrived."""
        self.resume_token: str | None = None
        """The latest resume token (session.opened or session.resumed), for session.resume."""
        self.close_reason: str | None = None
        """Why the session closed, from session.closed."""

    @property
    def state(self) -> State:
        """The session's state, as the server has it once it has read what was sent."""
        return self._state

    @property
    def busy(self) -> bool:
        """A chunk is in flight: sent (or announced), its response.done not received."""
        return self._state in (
            State.AWAITING_BINARY,
            State.AWAITING_RESPONSE,
            State.PARKED_AWAITING_RESPONSE,
        )

    @property
    def unanswered(self) -> tuple[Input, ...]:
        """The sent inputs the server has not answered yet, oldest first."""
        return tuple(sent.input for sent in self._unanswered)

    # -- what the client sends

    def send(self, event: ClientEvent) -> ClientEvent:
        """Check ``event`` against the tables and return it, to be sent; raise the server's
        own refusal (state unchanged) where the server would refuse it."""
        self._step(classify(event), event.event_id)
        return event

    def send_binary(self, data: bytes) -> bytes:
        """Check a binary message (the payload of a ``binary: true`` frame.append)."""
        self._step(Input.BINARY, None)
        return data

    def check(self, event: ClientEvent) -> None:
        """Raise the server's own refusal of ``event`` in the current state, as :meth:`send`
        would, without sending it (the state is unchanged either way)."""
        self._refuse(classify(event), event.event_id)

    def _refuse(self, inp: Input, event_id: str | None) -> None:
        refusal = REFUSALS.get((self._state, inp))
        if refusal is not None:
            raise refusal(
                f"{refusal.default_message} ({inp.value} in state {self._state.name})",
                event_id=event_id,
            )

    def _step(self, inp: Input, event_id: str | None) -> None:
        self._refuse(inp, event_id)
        pending = self._unanswered
        if inp is Input.BINARY and pending and pending[-1].input is Input.FRAME_ANNOUNCE:
            # The payload completes its announcement: one chunk, answered by one input.ack (or
            # refused by an error echoing the announcement's event_id).
            pending[-1] = _Sent(Input.BINARY, self._state, pending[-1].event_id)
        elif inp is not Input.RESPONSE_CANCEL:
            pending.append(_Sent(inp, self._state, event_id))
        self._state = TRANSITIONS[(self._state, inp)]

    def connection_lost(self) -> None:
        """The connection is gone: what the server does with its session, by the tables. An
        open session opened ``resumable`` is parked (``detach``: a new connection may resume
        it, with a new machine), any other session ends (``disconnect``)."""
        self._unanswered.clear()
        resumable = self.config is not None and self.config.resumable is not None
        live = self._state in (State.IDLE, State.AWAITING_BINARY, State.AWAITING_RESPONSE)
        inp = Input.DETACH if resumable and live else Input.DISCONNECT
        self._state = TRANSITIONS.get((self._state, inp), self._state)  # parked: already gone

    # -- what the server sends

    def receive(self, event: ServerEvent) -> None:
        """Apply a server event to the state (events that change nothing are accepted too)."""
        if isinstance(event, SessionCreatedEvent):
            self.session_id, self.limits = event.session_id, event.limits
        elif isinstance(event, SessionOpenedEvent):
            self._confirm(Input.SESSION_OPEN)
            self.config = event.config
            self.session_id, self.limits = event.session_id, event.limits
            self.resume_token = event.resume_token
        elif isinstance(event, SessionUpdatedEvent):
            self._confirm(Input.SESSION_UPDATE)
            self.config = event.config
        elif isinstance(event, InputAckEvent):
            self._ack(event)
        elif isinstance(event, ResponseDoneEvent):
            self._server_input(Input.RESPONSE_DONE)
            self.in_flight_frame_index = None
        elif isinstance(event, SessionResumedEvent):
            self._resumed(event)
        elif isinstance(event, SessionClosedEvent):
            self._unanswered.clear()
            self._state = State.CLOSED
            self.close_reason = event.reason
        elif isinstance(event, ErrorEvent):
            self._error(event)

    def _answered(self, *inputs: Input) -> _Sent | None:
        """Take the oldest unanswered send of one of ``inputs`` off the queue."""
        for sent in self._unanswered:
            if sent.input in inputs:
                self._unanswered.remove(sent)
                return sent
        return None

    def _confirm(self, inp: Input) -> None:
        self._answered(inp)

    def _ack(self, event: InputAckEvent) -> None:
        if self._answered(Input.FRAME_APPEND, Input.BINARY) is None:
            raise InternalError(f"input.ack with no chunk sent (state {self._state.name})")
        self.in_flight_frame_index = event.frame_index
        self.next_frame_index = event.frame_index + 1

    def _server_input(self, inp: Input) -> None:
        nxt = TRANSITIONS.get((self._state, inp))
        if nxt is None:
            raise InternalError(f"server sent {inp.value} in state {self._state.name}")
        self._state = nxt

    def _resumed(self, event: SessionResumedEvent) -> None:
        self._confirm(Input.SESSION_RESUME)
        parked = (
            State.PARKED
            if event.in_flight_frame_index is None
            else (State.PARKED_AWAITING_RESPONSE)
        )
        self._state = TRANSITIONS[(parked, Input.RESUMED)]
        self.session_id, self.limits, self.config = event.session_id, event.limits, event.config
        self.next_frame_index = event.next_frame_index
        self.in_flight_frame_index = event.in_flight_frame_index
        self.resume_token = event.resume_token

    def _error(self, event: ErrorEvent) -> None:
        if not event.error.session_survives:
            self._unanswered.clear()
            self._server_input(Input.FATAL_ERROR)
            return
        pending = list(self._unanswered)
        at = self._refused_at(pending, event.error.event_id)
        if at is None:  # it answers no send awaiting its answer (e.g. a late cancel's)
            return
        refused = pending[at]
        if TRANSITIONS.get((refused.before, refused.input), refused.before) is refused.before:
            # It moved nothing (session.update, session.resume), so nothing is undone: the
            # state may have moved since by the server's own events (a response.done).
            del self._unanswered[at]
            return
        state = REFUSED_PAYLOAD_STATE.get(refused.input, refused.before)
        # The sends after the refused one were stepped from a state that no longer holds:
        # step them again from where the refusal leaves the session.
        later = []
        for sent in pending[at + 1 :]:
            later.append(replace(sent, before=state))
            state = TRANSITIONS.get((state, sent.input), state)
        self._unanswered = deque([*pending[:at], *later])
        self._state = state

    @staticmethod
    def _refused_at(pending: list[_Sent], event_id: str | None) -> int | None:
        """Which unanswered send a surviving error refuses: the one whose ``event_id`` it
        echoes. An error with none answers a send that had none (the server echoes every
        event_id it gets; a binary message refused for want of an announcement has none): the
        oldest, passing over an announcement that later sends followed (the server answers an
        accepted announcement only with its payload's input.ack)."""
        if event_id is not None:
            return next((n for n, sent in enumerate(pending) if sent.event_id == event_id), None)
        unnamed = [n for n, sent in enumerate(pending) if sent.event_id is None]
        for k, n in enumerate(unnamed):
            if pending[n].input is not Input.FRAME_ANNOUNCE or k == len(unnamed) - 1:
                return n
        return None
