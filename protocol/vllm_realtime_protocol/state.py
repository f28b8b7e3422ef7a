"""Sans-I/O state machine of one connection's session.

Theory of operation
-------------------
A connection carries at most one session, and a session carries one
long-lived vLLM request.  The client feeds it *chunks* (``frame.append``: an
image, a clip, a binary message, or a text turn) and the server answers each
accepted chunk with exactly one reply.  Two rules hold everything together:

* **One chunk in flight.**  A ``frame.append`` is accepted only when the
  previous chunk's reply has finished; otherwise it is refused with
  ``chunk_in_flight`` (the session survives).
* **response.done is always sent for an accepted chunk.**  A chunk is
  *accepted* when :class:`SessionProtocol` returns :class:`SubmitFrame` (the
  server sends its ``input.ack``); from then on the server must eventually call
  :meth:`SessionProtocol.response_finished`, which builds the
  ``response.done``, whatever happens: completion, cancel, engine failure, or
  the session closing under it (then the reply is *drained*: aborted, and
  finished with status ``cancelled``/``failed`` even though the state is
  ``CLOSED``).

A session opened with ``resumable`` outlives its connection: when the socket
drops the server *detaches* it (``PARKED``, or ``PARKED_AWAITING_RESPONSE``
while its reply still runs; that reply's ``response.done`` is kept), and a
later connection that sends ``session.resume`` with the right token takes
the same machine over (*resumed*): frame indices go on, the kept
``response.done`` is handed over once in ``session.resumed``.  A parked
session nobody resumes *expires* after its grace period.

:class:`SessionProtocol` does no I/O and knows nothing of asyncio or vLLM.
The server feeds it every input (parsed client events, binary messages, and
its own happenings: reply finished, engine error, disconnect, idle timeout,
shutdown) and does what the returned :data:`Action` says; an input the
current state refuses raises the documented
:class:`~vllm_realtime_protocol.errors.RealtimeError` and leaves the state unchanged (the
one exception: a binary payload that fails its checks still consumes the
pending announcement, so the state returns to ``IDLE``).

State diagram::

                   session.open
      CONNECTED ──────────────────► IDLE ◄───────────────────────────┐
                ◄──────────────────  │ │                             │ response_done
                   open_refused      │ │ frame.append                │
                                     │ │ (image | video | text)      │
                                     │ └───────────────────► AWAITING_RESPONSE ───┐
                        frame.append │                          ▲         ▲       │ response.cancel
                      (binary: true) ▼                          │         └───────┘
                              AWAITING_BINARY ──────────────────┘
                                             binary payload

      CONNECTED | IDLE | AWAITING_BINARY | AWAITING_RESPONSE
          ── session.close | engine_error | disconnect | idle_timeout | server_shutdown | error ──►
      CLOSED   (a reply in flight at the close drains: one response_done is still allowed)

      IDLE | AWAITING_BINARY | AWAITING_RESPONSE ── session.update ──► the same state
          (settings of the next chunks; a reply in flight keeps its own)

    Resumable sessions (session.open with resumable), on the server's inputs:

      IDLE | AWAITING_BINARY ── detach ──► PARKED ── resumed ──► IDLE
      AWAITING_RESPONSE ── detach ──► PARKED_AWAITING_RESPONSE ── resumed ──► AWAITING_RESPONSE
      PARKED_AWAITING_RESPONSE ── response_done (kept for session.resumed) ──► PARKED
      PARKED | PARKED_AWAITING_RESPONSE ── expire | engine_error | server_shutdown | error ──► CLOSED
      CONNECTED ── session.resume ──► CONNECTED   (the server then hands the connection
                                                    the parked session's machine)

The transitions are the :data:`TRANSITIONS` table (``tables.py``, which the client's machine,
``client.py``, reads too); every other
(state, input) pair is in :data:`REFUSALS` with the error it raises.  The two
tables together cover every pair exactly once.  Three kinds of entries have a
guard: ``(IDLE, OPEN_REFUSED)`` needs that no chunk was accepted yet,
``(CLOSED, RESPONSE_DONE)`` needs a reply that was in flight at the close, and
``detach`` needs a session opened with ``resumable``; unguarded, they raise
``internal_error`` (a server bug).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from vllm_realtime_protocol.codec import MediaFormat, decode_base64_payload, sniff_media
from vllm_realtime_protocol.errors import (
    FrameTooLarge,
    InternalError,
    InvalidEvent,
    InvalidRequestError,
    RealtimeError,
    UndecodableFrame,
    truncate,
)
from vllm_realtime_protocol.events import (
    FIXED_SETTINGS,
    ClientEvent,
    CloseReason,
    FrameAppendEvent,
    FrameResize,
    InputAckEvent,
    Limits,
    ResponseCancelEvent,
    ResponseDoneEvent,
    ResponseFormat,
    ResponseStatus,
    RetentionState,
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
    new_session_id,
)
from vllm_realtime_protocol.tables import REFUSALS, TRANSITIONS, Input, State

__all__ = [
    "REFUSALS",
    "TRANSITIONS",
    "Action",
    "AwaitBinary",
    "CancelResponse",
    "CloseSession",
    "Frame",
    "Input",
    "OpenSession",
    "ResumeSession",
    "ServerCloseReason",
    "SessionProtocol",
    "State",
    "SubmitFrame",
]


ServerCloseReason: TypeAlias = Literal[
    "engine_error", "disconnect", "idle_timeout", "server_shutdown", "error", "expired"
]
_CLOSE_INPUTS: dict[ServerCloseReason, Input] = {
    "engine_error": Input.ENGINE_ERROR,
    "disconnect": Input.DISCONNECT,
    "idle_timeout": Input.IDLE_TIMEOUT,
    "server_shutdown": Input.SERVER_SHUTDOWN,
    "error": Input.FATAL_ERROR,
    "expired": Input.EXPIRE,
}


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Frame:
    """An accepted chunk, payload decoded and checked."""

    frame_index: int
    """Server sequence number: 0, 1, 2, … over the session's accepted chunks."""
    frame_id: str | None
    """Client's label, echoed on every event about this chunk."""
    kind: Literal["image", "video", "text"]
    """What the chunk is."""
    media_format: MediaFormat | None
    """Sniffed container of image/video chunks; None for text."""
    data: bytes = field(repr=False)
    """Decoded payload (UTF-8 of the text for text chunks)."""
    text: str | None
    """The text turn, for text chunks."""
    prompt: str | None
    """Per-chunk prompt, if the client sent one."""
    timestamp: float | None
    """Client capture time, if sent."""
    reply: bool = True
    """False: prefill only (``frame.append.reply``); the reply is 'ingested', nothing generated."""
    response_format: ResponseFormat | None = None
    """This chunk's reply format, overriding the session's; None: the session's."""


@dataclass(frozen=True, slots=True)
class OpenSession:
    """Admit the session: open the engine request, then send ``event`` (session.opened).

    If admission fails, call :meth:`SessionProtocol.open_refused` and send the error instead.
    """

    config: SessionConfig
    event: SessionOpenedEvent


@dataclass(frozen=True, slots=True)
class AwaitBinary:
    """Nothing to do: the payload of this frame.append is the next binary message."""

    frame_id: str | None


@dataclass(frozen=True, slots=True)
class SubmitFrame:
    """Send ``ack`` (input.ack), feed ``frame`` to the engine, stream the reply.

    Finish with :meth:`SessionProtocol.response_finished` and send the
    response.done it returns.
    """

    frame: Frame
    ack: InputAckEvent


@dataclass(frozen=True, slots=True)
class CancelResponse:
    """Abort the engine's work on ``frame_index``; finish it with status 'cancelled'."""

    frame_index: int


@dataclass(frozen=True, slots=True)
class CloseSession:
    """End the session: drain ``in_flight`` (abort, then response_finished), send
    ``event`` (session.closed) if the socket is still up, then close the socket.
    """

    reason: CloseReason
    in_flight: Frame | None
    event: SessionClosedEvent


@dataclass(frozen=True, slots=True)
class ResumeSession:
    """Look up the parked session ``session_id`` and check ``resume_token`` (and the API key);
    if both hold, call its machine's :meth:`SessionProtocol.resumed` and carry on with that
    machine on this connection; otherwise refuse with ``session_not_found``."""

    session_id: str
    resume_token: str
    event_id: str | None


@dataclass(frozen=True, slots=True)
class UpdateSession:
    """Apply ``config`` to the engine session's later chunks, then send ``event``
    (session.updated). If the server refuses it, call :meth:`SessionProtocol.update_refused`
    with ``previous`` and send the error instead."""

    config: SessionConfig
    previous: SessionConfig
    event: SessionUpdatedEvent


Action: TypeAlias = (
    OpenSession
    | AwaitBinary
    | SubmitFrame
    | CancelResponse
    | CloseSession
    | ResumeSession
    | UpdateSession
)
"""What the server must do after an input."""


# --------------------------------------------------------------------------- machine


def classify(event: ClientEvent) -> Input:
    """The state-machine input a parsed client event is."""
    if isinstance(event, SessionOpenEvent):
        return Input.SESSION_OPEN
    if isinstance(event, FrameAppendEvent):
        return Input.FRAME_ANNOUNCE if event.binary else Input.FRAME_APPEND
    if isinstance(event, ResponseCancelEvent):
        return Input.RESPONSE_CANCEL
    if isinstance(event, SessionCloseEvent):
        return Input.SESSION_CLOSE
    if isinstance(event, SessionResumeEvent):
        return Input.SESSION_RESUME
    if isinstance(event, SessionUpdateEvent):
        return Input.SESSION_UPDATE
    raise InternalError(f"not a client event: {type(event).__name__}")  # pragma: no cover


class SessionProtocol:
    """The session state of one connection; feed it inputs, do what it returns.

    Typical server loop::

        proto = SessionProtocol(limits)
        send(proto.greeting())
        for message in websocket:
            try:
                if binary: action = proto.receive_binary(message)
                else:      action = proto.receive_client_event(parse_client_event(message))
            except RealtimeError as exc:
                send(error_event(exc))
                if not exc.session_survives:
                    action = proto.server_close("error")
            ...  # carry out `action`
    """

    def __init__(self, limits: Limits, *, session_id: str | None = None) -> None:
        self.limits = limits
        """Limits announced to the client and enforced here (frame size, max_tokens cap)."""
        self.session_id = session_id or new_session_id()
        """Id of this connection's session, announced in session.created."""
        self.config: SessionConfig | None = None
        """Effective settings once session.open was accepted."""
        self.in_flight: Frame | None = None
        """The accepted chunk whose reply is not finished (at most one)."""
        self.pending_frame: FrameAppendEvent | None = None
        """The ``binary: true`` frame.append waiting for its payload."""
        self.cancel_requested = False
        """Whether response.cancel arrived for the reply in flight."""
        self.close_reason: CloseReason | None = None
        """Why the session closed, once CLOSED."""
        self.frames_total = 0
        """Chunks accepted so far; also the next frame_index."""
        self.responses: dict[ResponseStatus, int] = {}
        """Finished replies by status."""
        self.missed_response: ResponseDoneEvent | None = None
        """The response.done that finished while the session was parked, until resumed."""
        self._state = State.CONNECTED

    @classmethod
    def restored(
        cls,
        limits: Limits,
        *,
        session_id: str,
        config: SessionConfig,
        frames_total: int,
        responses: dict[ResponseStatus, int],
    ) -> SessionProtocol:
        """The machine of a session rebuilt on another server from a session store (issue
        #39): PARKED, as its owner left it at its last reply, awaiting ``resumed``."""
        if config.resumable is None:
            raise InternalError("only a resumable session can be restored")
        proto = cls(limits, session_id=session_id)
        proto.config = config
        proto.frames_total = frames_total
        proto.responses = dict(responses)
        proto._state = State.PARKED
        return proto

    @property
    def state(self) -> State:
        """The current state."""
        return self._state

    def greeting(self) -> SessionCreatedEvent:
        """The session.created event to send on connect."""
        return SessionCreatedEvent(session_id=self.session_id, limits=self.limits)

    # -- the table

    def _next_state(self, inp: Input, event_id: str | None = None) -> State:
        key = (self._state, inp)
        refusal = REFUSALS.get(key)
        if refusal is not None:
            raise refusal(
                f"{refusal.default_message} ({inp.value} in state {self._state.name})",
                event_id=event_id,
            )
        return TRANSITIONS[key]

    # -- client inputs

    def receive_client_event(self, event: ClientEvent) -> Action:
        """Apply a parsed client event; return the server's action or raise its refusal."""
        inp = classify(event)
        nxt = self._next_state(inp, event.event_id)
        if isinstance(event, SessionOpenEvent):
            return self._open(event, nxt)
        if isinstance(event, FrameAppendEvent):
            return self._append(event, nxt)
        if isinstance(event, ResponseCancelEvent):
            assert self.in_flight is not None
            self.cancel_requested = True
            return CancelResponse(frame_index=self.in_flight.frame_index)
        if isinstance(event, SessionResumeEvent):
            self._state = nxt
            return ResumeSession(event.session_id, event.resume_token, event.event_id)
        if isinstance(event, SessionUpdateEvent):
            return self._update(event, nxt)
        return self._close("client_closed", nxt)

    def update_refused(self, previous: SessionConfig) -> None:
        """The server could not apply a session.update (e.g. a response_format it refuses):
        the settings go back to ``previous``."""
        self.config = previous

    def receive_binary(self, data: bytes) -> SubmitFrame:
        """Apply a binary WebSocket message: the payload of the pending ``binary: true`` frame."""
        event_id = self.pending_frame.event_id if self.pending_frame else None
        nxt = self._next_state(Input.BINARY, event_id)
        announce = self.pending_frame
        assert announce is not None and self.config is not None
        self.pending_frame = None
        self._state = State.IDLE  # the announcement is consumed even if the payload is refused
        self._check_size(len(data), event_id)
        media = sniff_media(data)
        if media is None:
            raise UndecodableFrame(
                "binary payload is not JPEG, PNG, WebP, MP4 or WebM", event_id=event_id
            )
        kind: Literal["image", "video"] = "video" if media in ("mp4", "webm") else "image"
        self._check_format(kind, media, event_id)
        return self._accept(announce, nxt, kind=kind, media=media, data=data)

    # -- server inputs

    def open_refused(self) -> None:
        """Admission refused the session just opened: back to CONNECTED (open may be retried)."""
        nxt = self._next_state(Input.OPEN_REFUSED)
        if self.frames_total:
            raise InternalError("open_refused after chunks were accepted")
        self.config = None
        self._state = nxt

    def response_finished(
        self,
        status: ResponseStatus,
        *,
        text: str = "",
        status_reason: str | None = None,
        usage: Usage | None = None,
        timing: Timing | None = None,
        retention: RetentionState | None = None,
        resized: FrameResize | None = None,
    ) -> ResponseDoneEvent:
        """The reply in flight ended; return its response.done (also while draining in CLOSED)."""
        nxt = self._next_state(Input.RESPONSE_DONE)
        frame = self.in_flight
        if frame is None:
            raise InternalError("response_finished with no reply in flight")
        self.in_flight = None
        self.cancel_requested = False
        self.responses[status] = self.responses.get(status, 0) + 1
        done = ResponseDoneEvent(
            frame_index=frame.frame_index,
            frame_id=frame.frame_id,
            status=status,
            status_reason=status_reason,
            text=text,
            usage=usage or Usage(),
            timing=timing or Timing(),
            retention=retention or RetentionState(),
            resized=resized,
        )
        if self._state is State.PARKED_AWAITING_RESPONSE:
            self.missed_response = done  # nobody to send it to: session.resumed carries it
        self._state = nxt
        return done

    def detach(self) -> None:
        """The connection of a resumable session dropped: park the session (see the table)."""
        nxt = self._next_state(Input.DETACH)
        if self.config is None or self.config.resumable is None:
            raise InternalError("detach of a session opened without resumable")
        self.pending_frame = None
        self._state = nxt

    def resumed(self, resume_token: str) -> SessionResumedEvent:
        """A new connection took the parked session over; the session.resumed to send it.

        ``resume_token`` is the new secret the server issued for the next resume."""
        nxt = self._next_state(Input.RESUMED)
        assert self.config is not None
        missed, self.missed_response = self.missed_response, None  # handed over exactly once
        self._state = nxt
        return SessionResumedEvent(
            session_id=self.session_id,
            config=self.config,
            limits=self.limits,
            next_frame_index=self.frames_total,
            in_flight_frame_index=None if self.in_flight is None else self.in_flight.frame_index,
            missed_response=missed,
            resume_token=resume_token,
        )

    def server_close(self, reason: ServerCloseReason) -> CloseSession | None:
        """The server ends the session (or the socket dropped); None if already CLOSED."""
        if self._state is State.CLOSED:
            return None
        return self._close(reason, self._next_state(_CLOSE_INPUTS[reason]))

    # -- helpers

    def _open(self, event: SessionOpenEvent, nxt: State) -> OpenSession:
        requested = event.session_config()
        if requested.model is not None and requested.model != self.limits.model:
            raise InvalidEvent(
                f"session.open.model: {truncate(requested.model, 80)!r} is not served here; "
                f"this server serves {self.limits.model!r}",
                event_id=event.event_id,
                param="model",
            )
        sampling = requested.sampling.model_copy(
            update={"max_tokens": min(requested.sampling.max_tokens, self.limits.max_tokens_cap)}
        )
        resumable = requested.resumable
        if resumable is not None:
            # Capped by the server; a server that allows no grace makes it a plain session.
            cap = self.limits.max_resume_grace_s
            resumable = (
                resumable.model_copy(update={"grace_s": min(resumable.grace_s, cap)})
                if cap > 0
                else None
            )
        config = requested.model_copy(
            update={"model": self.limits.model, "sampling": sampling, "resumable": resumable}
        )
        self.config = config
        self._state = nxt
        opened = SessionOpenedEvent(session_id=self.session_id, config=config, limits=self.limits)
        return OpenSession(config=config, event=opened)

    def _update(self, event: SessionUpdateEvent, nxt: State) -> UpdateSession:
        assert self.config is not None
        for name in FIXED_SETTINGS:
            if name in event.model_fields_set and getattr(event, name) is not None:
                raise InvalidRequestError(
                    f"session.update cannot change {name}: it is fixed for the session's "
                    "life (the KV cache or the admission reservation holds it); open a new "
                    "session instead",
                    event_id=event.event_id,
                    param=name,
                )
        previous = self.config
        update: dict[str, object] = {}
        if event.sampling is not None:
            changes = {k: getattr(event.sampling, k) for k in event.sampling.model_fields_set}
            if "max_tokens" in changes:
                changes["max_tokens"] = min(event.sampling.max_tokens, self.limits.max_tokens_cap)
            update["sampling"] = previous.sampling.model_copy(update=changes)
        if event.frame_format is not None:
            update["frame_format"] = event.frame_format
        config = previous.model_copy(update=update)
        self.config = config
        self._state = nxt
        updated = SessionUpdatedEvent(session_id=self.session_id, config=config)
        return UpdateSession(config=config, previous=previous, event=updated)

    def _append(self, event: FrameAppendEvent, nxt: State) -> AwaitBinary | SubmitFrame:
        assert self.config is not None
        kind = event.payload_kind
        # A video session takes text too: a question about what its window holds. A text
        # session takes text only.
        if kind != "text" and self.config.modality == "text":
            wanted = "'text'"
            raise InvalidEvent(
                f"frame.append.{kind}: a {self.config.modality} session takes {wanted} payloads",
                event_id=event.event_id,
                param=kind,
            )
        if kind == "binary":
            self.pending_frame = event
            self._state = nxt
            return AwaitBinary(frame_id=event.frame_id)
        if kind == "text":
            assert event.text is not None
            data = event.text.encode("utf-8")
            self._check_size(len(data), event.event_id, param="text")
            return self._accept(event, nxt, kind="text", media=None, data=data)
        encoded = event.image if kind == "image" else event.video
        assert encoded is not None
        try:
            data = decode_base64_payload(encoded, max_bytes=self.limits.max_frame_bytes)
        except RealtimeError as exc:
            exc.event_id = event.event_id
            exc.param = kind
            raise
        media = sniff_media(data)
        self._check_format(kind, media, event.event_id, param=kind)
        return self._accept(event, nxt, kind=kind, media=media, data=data)

    def _check_size(self, size: int, event_id: str | None, param: str | None = None) -> None:
        if size > self.limits.max_frame_bytes:
            raise FrameTooLarge(
                f"payload is {size} bytes; the limit is {self.limits.max_frame_bytes}",
                event_id=event_id,
                param=param,
            )

    def _check_format(
        self,
        kind: Literal["image", "video"],
        media: MediaFormat | None,
        event_id: str | None,
        param: str | None = None,
    ) -> None:
        """``param``: the event field that carried the payload (None: a binary message)."""
        assert self.config is not None
        if kind == "video":
            if media not in ("mp4", "webm"):
                raise UndecodableFrame(
                    "video payload is not MP4 or WebM", event_id=event_id, param=param
                )
            return
        if media not in ("jpeg", "png", "webp"):
            raise UndecodableFrame(
                "image payload is not JPEG, PNG or WebP", event_id=event_id, param=param
            )
        wanted = self.config.frame_format
        if wanted != "auto" and media != wanted:
            raise UndecodableFrame(
                f"image payload is {media.upper()} but the session's frame_format is {wanted!r}",
                event_id=event_id,
                param=param,
            )

    def _accept(
        self,
        event: FrameAppendEvent,
        nxt: State,
        *,
        kind: Literal["image", "video", "text"],
        media: MediaFormat | None,
        data: bytes,
    ) -> SubmitFrame:
        frame = Frame(
            frame_index=self.frames_total,
            frame_id=event.frame_id,
            kind=kind,
            media_format=media,
            data=data,
            text=event.text,
            prompt=event.prompt,
            timestamp=event.timestamp,
            reply=event.reply,
            response_format=event.response_format,
        )
        self.frames_total += 1
        self.in_flight = frame
        self.cancel_requested = False
        self._state = nxt
        ack = InputAckEvent(frame_index=frame.frame_index, frame_id=frame.frame_id, bytes=len(data))
        return SubmitFrame(frame=frame, ack=ack)

    def _close(self, reason: CloseReason, nxt: State) -> CloseSession:
        self.pending_frame = None
        self.close_reason = reason
        self._state = nxt
        event = SessionClosedEvent(
            session_id=self.session_id, reason=reason, frames_total=self.frames_total
        )
        return CloseSession(reason=reason, in_flight=self.in_flight, event=event)
