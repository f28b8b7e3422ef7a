"""The asyncio client: one WebSocket, one session, one chunk in flight.

::

    async with connect("ws://127.0.0.1:8000/v1/realtime", api_key=key) as session:
        await session.open(instructions="Describe each frame.", sampling={"max_tokens": 32})
        done = await session.append_frame(jpeg, prompt="What changed?")
        print(done.text, done.timing.total_ms)

        async for delta in (stream := session.stream_frame(jpeg2)):
            print(delta.delta, end="", flush=True)
        print(stream.done.retention.kv_blocks_held)

One background task reads the socket and routes every server event to the call waiting for it:
``session.opened`` (or the ``error`` echoing the open's ``event_id``) to :meth:`open`;
``input.ack`` / ``response.created`` / ``response.text.delta`` / ``response.done`` to the reply
in flight; ``session.closed`` ends everything.  Every client event carries an ``event_id``, so
an error is matched to the call that caused it; errors that answer no pending call (e.g. the
``undecodable_frame`` that follows a ``failed`` reply) are kept in :attr:`RealtimeSession.errors`.

A session opened with ``resumable={"grace_s": N}`` is *resilient*: when the socket drops, the
reader reconnects (at most ``max_retries`` times, with backoff) and sends ``session.resume``; the
reply in flight then completes from ``session.resumed`` (its ``response.done``, or the rest of
the stream), and a chunk the server never accepted is sent again.  When the server drains
(``server.draining``) or the session cannot be resumed (expired, the server restarted), it opens
a new session with the same settings on a new connection: :attr:`RealtimeSession.session_id`
changes and :attr:`RealtimeSession.generation` counts up.  A drain that hands the session over
(``server.draining`` with ``handover``: replicas sharing a session store) is followed by a
resume instead, on whichever replica the reconnect reaches (through the router, e.g. with a
``?session_key=`` of the client's own on the URL): the same session, its context intact.  Calls
made meanwhile wait.  An accepted chunk whose reply was lost with its server (killed, or its
engine died; the session store is at the last ``response.done``) is sent once more to the
resumed session, with a warning in the log (:attr:`RealtimeSession.chunks_resent`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeAlias, TypeVar

from pydantic import BaseModel, ValidationError
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

import vllm_realtime_client.recovery as recovery
from vllm_realtime_client.errors import (
    ConnectError,
    ConnectionLost,
    FrameTooLarge,
    InvalidEvent,
    RealtimeError,
    ResponseTimeout,
    SessionClosed,
    Unauthorized,
    UndecodableFrame,
    error_from_detail,
)
from vllm_realtime_client.forms import _DEFAULT, SessionForms, _Default, _Timeout
from vllm_realtime_protocol.client import ClientProtocol
from vllm_realtime_protocol.codec import encode_client_event, parse_server_event, sniff_media
from vllm_realtime_protocol.constants import AUTH_SUBPROTOCOL_PREFIX, SUBPROTOCOL
from vllm_realtime_protocol.errors import InternalError, VllmRealtimeError
from vllm_realtime_protocol.events import (
    ChunkLimits,
    ClientEvent,
    ErrorEvent,
    FrameAppendEvent,
    FrameFormat,
    InputAckEvent,
    Modality,
    ResponseCancelEvent,
    ResponseCreatedEvent,
    ResponseDoneEvent,
    ResponseFormat,
    ResponseTextDeltaEvent,
    ResumableConfig,
    RetentionConfig,
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
    SessionUpdatedEvent,
    SessionUpdateEvent,
)
from vllm_realtime_protocol.tables import State

__all__ = ["AuthMethod", "Connector", "RealtimeSession", "ResponseStream", "connect"]

log = logging.getLogger("vllm_realtime_client")

AuthMethod: TypeAlias = Literal["header", "subprotocol"]
"""How the API key travels: ``Authorization: Bearer`` (default) or the auth subprotocol."""

_MAX_KEPT_ERRORS = 64
_T = TypeVar("_T")
_E = TypeVar("_E", SessionResumedEvent, SessionOpenedEvent)


def _model(cls: type[BaseModel], value: Any) -> Any:
    """``value`` as an instance of ``cls`` (a dict is validated), or None."""
    if value is None or isinstance(value, cls):
        return value
    try:
        return cls.model_validate(dict(value))
    except ValidationError as exc:
        raise InvalidEvent(f"{cls.__name__}: {_first_error(exc)}") from None


def _first_error(exc: ValidationError) -> str:
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = ".".join(str(part) for part in first["loc"])
    return f"{loc}: {first['msg']}" if loc else str(first["msg"])


@dataclass
class _Payload:
    """What one frame.append carries, ready to send."""

    event: FrameAppendEvent
    binary: bytes | None = None


class _Turn:
    """Book-keeping of the one chunk in flight."""

    def __init__(self, event_id: str, frame_id: str | None) -> None:
        self.event_id = event_id
        self.frame_id = frame_id
        # What was sent, to send again if the server never accepted it (resilient sessions).
        self.items: list[ClientEvent | bytes] = []
        self.events: asyncio.Queue[ServerEvent | BaseException] = asyncio.Queue()
        self.finished = asyncio.Event()
        self.ack: InputAckEvent | None = None
        self.created: ResponseCreatedEvent | None = None
        self.done: ResponseDoneEvent | None = None
        self.error: BaseException | None = None
        # The caller gave up on it (timeout, task cancelled): the SDK cancelled it, so the next
        # chunk waits for its response.done instead of being refused.
        self.abandoned = False
        # Sent again after a resume that lost its reply (the server died with it): once only.
        self.resent = False

    def matches(self, frame_index: int) -> bool:
        return self.ack is not None and self.ack.frame_index == frame_index

    def finish(self, done: ResponseDoneEvent) -> None:
        self.done = done
        self.events.put_nowait(done)
        self.finished.set()

    def fail(self, exc: BaseException) -> None:
        if self.finished.is_set():
            return
        self.error = exc
        self.events.put_nowait(exc)
        self.finished.set()


class ResponseStream:
    """The reply to one chunk as it streams: an async iterator of its text deltas.

    The chunk is sent when iteration starts (so nothing is sent if the stream is never
    iterated).  Iteration yields each :class:`~vllm_realtime_protocol.events.ResponseTextDeltaEvent` and
    ends at ``response.done``, which is then in :attr:`done`; it raises the typed error if the
    chunk was refused (:class:`~vllm_realtime_protocol.errors.ChunkInFlight`,
    :class:`~vllm_realtime_protocol.errors.UndecodableFrame`, …), :class:`ResponseTimeout` if the reply took
    longer than ``timeout`` (the reply is then cancelled), or the session's fatal error.

    Leaving the loop early does **not** cancel the reply (call :meth:`RealtimeSession.cancel`);
    the next chunk waits for its ``response.done``.
    """

    def __init__(self, session: RealtimeSession, payload: _Payload, timeout: float | None):
        self._session = session
        self._payload = payload
        self._timeout = timeout
        self._turn: _Turn | None = None
        self._deadline: float | None = None
        self._over = False
        self._error: BaseException | None = None
        self._parts: list[str] = []

    @property
    def ack(self) -> InputAckEvent | None:
        """The ``input.ack`` (the chunk's ``frame_index``), once it arrived."""
        return None if self._turn is None else self._turn.ack

    @property
    def created(self) -> ResponseCreatedEvent | None:
        """The ``response.created``, once it arrived."""
        return None if self._turn is None else self._turn.created

    @property
    def done(self) -> ResponseDoneEvent | None:
        """The ``response.done``, once iteration has ended."""
        return None if self._turn is None else self._turn.done

    @property
    def text(self) -> str:
        """The reply's text streamed so far."""
        return "".join(self._parts)

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> ResponseTextDeltaEvent:
        if self._over:
            raise StopAsyncIteration
        if self._turn is None:
            self._turn, self._deadline = await self._session._start_turn(
                self._payload, self._timeout
            )
        while True:
            try:
                item = await self._session._next_item(self._turn, self._deadline)
            except BaseException as exc:
                self._over = True
                if isinstance(exc, Exception):
                    self._error = exc
                raise
            if isinstance(item, BaseException):
                self._over = True
                self._error = item
                raise item
            if isinstance(item, ResponseCreatedEvent):
                # A second response.created: the chunk was sent again after its reply was lost
                # with its server (see RealtimeSession.chunks_resent); the text starts over.
                self._parts.clear()
            if isinstance(item, ResponseTextDeltaEvent):
                self._parts.append(item.delta)
                return item
            if isinstance(item, ResponseDoneEvent):
                self._over = True
                raise StopAsyncIteration

    async def result(self) -> ResponseDoneEvent:
        """Consume the rest of the stream and return its ``response.done``."""
        async for _ in self:
            pass
        if self._error is not None:
            raise self._error
        done = self.done
        if done is None:  # iteration ended by an error raised earlier
            raise SessionClosed("the reply ended without a response.done")
        return done


class RealtimeSession(SessionForms):
    """A connection to ``/v1/realtime`` and its one session.  Made by :func:`connect`.

    The session's state is the protocol's own client machine
    (:class:`~vllm_realtime_protocol.client.ClientProtocol`, :attr:`protocol`): every event
    goes through it before the socket, so what the server would refuse (a second chunk in
    flight, a chunk before ``open``) is refused here with the server's own error, and every
    server event goes through it first.  One streaming verb, :meth:`stream`, sends a chunk;
    ``append_frame``, ``ask`` and the other chunk calls are one-line forms of it
    (:mod:`vllm_realtime_client.forms`).  A live source should not queue frames here: check
    :attr:`busy` and drop frames instead (``offer_frame``).
    """

    def __init__(
        self,
        ws: ClientConnection,
        created: SessionCreatedEvent,
        *,
        timeout: float | None,
        close_timeout: float,
        on_event: Callable[[ServerEvent], None] | None,
        connector: Connector | None = None,
        on_resumed: Callable[[SessionResumedEvent], None] | None = None,
        on_reopened: Callable[[SessionOpenedEvent], None] | None = None,
    ) -> None:
        self._ws = ws
        self._created = created
        self._proto = ClientProtocol()
        self._proto.receive(created)
        self._connector = connector
        # What the caller got from open() (or a resume): the machine holds its config.
        self._opened: SessionOpenedEvent | None = None
        self._closed: SessionClosedEvent | None = None
        self._fatal: BaseException | None = None
        self._timeout = timeout
        self._close_timeout = close_timeout
        self._on_event = on_event
        self._on_resumed = on_resumed
        self._on_reopened = on_reopened
        # Queues of the open `events()` iterators; None in a queue ends its iterator.
        self._subscribers: set[asyncio.Queue[ServerEvent | None]] = set()
        self.dropped = 0
        """Frames ``offer_frame`` dropped because a chunk was in flight (or the session was
        moving to a new connection)."""
        self._ids = itertools.count(1)
        self._send_lock = asyncio.Lock()
        self._turn_lock = asyncio.Lock()
        self._turn: _Turn | None = None
        self._open_wait: tuple[str, asyncio.Future[SessionOpenedEvent]] | None = None
        self._update_waits: dict[str, asyncio.Future[SessionUpdatedEvent]] = {}
        self._cancel_ids: set[str] = set()
        self._ended = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()
        self.errors: deque[VllmRealtimeError] = deque(maxlen=_MAX_KEPT_ERRORS)
        """Surviving ``error`` events that answered no pending call, and server events the
        protocol machine found out of order (an ``InternalError``: a server bug), newest last."""
        # Resilience (resumable sessions): whether chunks may be sent now (cleared while
        # reconnecting or draining).
        self._ready = asyncio.Event()
        self._ready.set()
        self._moving = False  # session.closed(server_shutdown) of a resilient session arrived
        self._user_closing = False
        self.generation = 1
        """Sessions this object has been through: 1, then +1 for every new session it opened
        after a drain or a failed resume (a resumed session keeps its number)."""
        self.resumes = 0
        """Successful session.resume so far."""
        self.chunks_resent = 0
        """Chunks sent again after a resume because their reply was lost with the server that
        ran it (killed, or its engine died: the session store is at the last response.done)."""
        self.draining: ServerDrainingEvent | None = None
        """The last ``server.draining`` received on the current connection."""
        self._reader = asyncio.create_task(self._read_loop(), name="vllm-realtime-reader")

    # ------------------------------------------------------------------ state

    @property
    def protocol(self) -> ClientProtocol:
        """The session's protocol machine (state, config, next frame index, resume token)."""
        return self._proto

    @property
    def session_id(self) -> str:
        """The session's id (from ``session.opened``, ``session.resumed`` or the greeting)."""
        return self._proto.session_id or self._created.session_id

    @property
    def busy(self) -> bool:
        """True while a chunk is in flight (sent, its ``response.done`` not yet received)."""
        if self._ended.is_set():
            return False
        return self._proto.busy or self._proto.in_flight_frame_index is not None

    @property
    def closed(self) -> SessionClosedEvent | None:
        """The ``session.closed`` event, once the session ended."""
        if self._proto.state is not State.CLOSED or self._moving:
            return None
        return self._closed

    # ------------------------------------------------------------------ calls

    async def open(
        self,
        config: SessionConfig | Mapping[str, Any] | None = None,
        *,
        instructions: str | None = None,
        modality: Modality | None = None,
        retention: RetentionConfig | Mapping[str, Any] | None = None,
        sampling: SamplingConfig | Mapping[str, Any] | None = None,
        frame_format: FrameFormat | None = None,
        model: str | None = None,
        resumable: ResumableConfig | Mapping[str, Any] | None = None,
        limits: ChunkLimits | Mapping[str, Any] | None = None,
        timeout: _Timeout = _DEFAULT,
    ) -> SessionOpenedEvent:
        """Send ``session.open`` and return the server's ``session.opened``.

        ``resumable={"grace_s": N}`` makes the session resilient (see the module docstring).
        ``limits`` declares what the session sends, and admission reserves for exactly that
        (``opened.reservation``): by default single images (or text turns) at one chunk a
        second. A session that sends clips declares them, e.g.
        ``limits={"max_clip_frames": 16}`` (a clip over the declared cap is refused with
        ``chunk_too_large``); a faster or slower camera declares its pace,
        ``limits={"frames_per_s": 5}``; ``{"max_chunk_tokens": 32}`` caps a chunk's text.

        ``config`` gives all settings at once; keyword arguments override its fields
        (``retention`` and ``sampling`` may be dicts, e.g. ``{"window_chunks": 4}``).
        Raises :class:`~vllm_realtime_protocol.errors.CapacityExceeded` when the server is full (the
        connection stays usable: call ``open`` again later), or
        :class:`~vllm_realtime_protocol.errors.InvalidEvent` for settings the server refuses.
        """
        self._check_alive()
        fields: dict[str, Any] = {}
        base = _model(SessionConfig, config)
        if base is not None:
            fields.update({name: getattr(base, name) for name in SessionConfig.model_fields})
        overrides = {
            "instructions": instructions,
            "modality": modality,
            "retention": _model(RetentionConfig, retention),
            "sampling": _model(SamplingConfig, sampling),
            "frame_format": frame_format,
            "model": model,
            "resumable": _model(ResumableConfig, resumable),
            "limits": _model(ChunkLimits, limits),
        }
        fields.update({k: v for k, v in overrides.items() if v is not None})
        event_id = self._new_id()
        try:
            event = SessionOpenEvent(event_id=event_id, **fields)
        except ValidationError as exc:
            raise InvalidEvent(f"session.open: {_first_error(exc)}") from None
        self._proto.check(event)  # session_already_open, session_closed
        future: asyncio.Future[SessionOpenedEvent] = asyncio.get_running_loop().create_future()
        self._open_wait = (event_id, future)
        try:
            await self._send(event)
            opened = await self._wait(future, self._resolve_timeout(timeout), "session.opened")
        finally:
            self._open_wait = None
        self._opened = opened
        return opened

    def stream(
        self,
        chunk: bytes | str,
        *,
        prompt: str | None = None,
        frame_id: str | None = None,
        timestamp: float | None = None,
        binary: bool = True,
        reply: bool = True,
        response_format: ResponseFormat | dict[str, Any] | None = None,
        timeout: _Timeout = _DEFAULT,
    ) -> ResponseStream:
        """Send one chunk and stream its reply: ``bytes`` are an image (JPEG/PNG/WebP) or a
        clip (MP4/WebM), a ``str`` is a text turn (in a ``"video"`` session, a question about
        what the window holds).

        ``reply=False`` only prefills it (status ``ingested``); ``response_format``
        constrains this reply (OpenAI's shape), overriding the session's.  ``binary=True``
        (default) sends image bytes as a binary WebSocket message after a ``frame.append``
        with ``"binary": true``; ``binary=False`` sends base64 inside the JSON.  Size and
        format are checked here first (:class:`~vllm_realtime_protocol.errors.FrameTooLarge`,
        :class:`~vllm_realtime_protocol.errors.UndecodableFrame`), without a round trip.
        """
        common: dict[str, Any] = {"prompt": prompt, "frame_id": frame_id, "timestamp": timestamp}
        if not reply:
            common["reply"] = False
        if response_format is not None:
            common["response_format"] = response_format
        if isinstance(chunk, str):
            payload = _Payload(self._frame_event(text=chunk, **common))
        else:
            payload = self._media_payload(chunk, binary, common)
        return ResponseStream(self, payload, self._resolve_timeout(timeout))

    async def update(
        self,
        *,
        sampling: SamplingConfig | Mapping[str, Any] | None = None,
        frame_format: FrameFormat | None = None,
        timeout: _Timeout = _DEFAULT,
    ) -> SessionUpdatedEvent:
        """Send ``session.update`` and return ``session.updated``: later chunks use the new
        settings (a reply in flight keeps its own).  ``sampling`` changes only the fields it
        names, e.g. ``update(sampling={"temperature": 0.7})``.  The instructions, retention,
        modality and limits are fixed for the session's life (the server refuses them with
        ``invalid_request``, its ``param`` naming the field)."""
        self._check_alive()
        fields: dict[str, Any] = {}
        if sampling is not None:
            fields["sampling"] = (
                sampling if isinstance(sampling, SamplingConfig) else dict(sampling)
            )
        if frame_format is not None:
            fields["frame_format"] = frame_format
        event_id = self._new_id()
        try:
            event = SessionUpdateEvent.model_validate({"event_id": event_id, **fields})
        except ValidationError as exc:
            raise InvalidEvent(f"session.update: {_first_error(exc)}") from None
        future: asyncio.Future[SessionUpdatedEvent] = asyncio.get_running_loop().create_future()
        self._update_waits[event_id] = future
        try:
            await self._send(event)  # the machine refuses it before open: session_not_open
            return await self._wait(future, self._resolve_timeout(timeout), "session.updated")
        finally:
            del self._update_waits[event_id]

    def events(self) -> AsyncIterator[ServerEvent]:
        """Every server event from now on, in order, until the session ends: ``async for
        event in session.events()`` (or ``async for event in session``).  Each iterator gets
        every event; stop iterating (``break``) to unsubscribe."""
        queue: asyncio.Queue[ServerEvent | None] = asyncio.Queue()
        self._subscribers.add(queue)
        if self._ended.is_set():
            queue.put_nowait(None)
        return self._iterate(queue)

    def __aiter__(self) -> AsyncIterator[ServerEvent]:
        return self.events()

    async def _iterate(
        self, queue: asyncio.Queue[ServerEvent | None]
    ) -> AsyncIterator[ServerEvent]:
        try:
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._subscribers.discard(queue)

    async def cancel(self, *, timeout: _Timeout = _DEFAULT) -> ResponseDoneEvent | None:
        """Cancel the reply in flight and return its ``response.done`` (None if none was in
        flight).  Its status is ``cancelled``, or ``completed`` if it finished first."""
        turn = self._turn
        if turn is None or turn.finished.is_set():
            return None
        await self._send_cancel(turn)
        try:
            await asyncio.wait_for(turn.finished.wait(), self._resolve_timeout(timeout))
        except asyncio.TimeoutError:
            raise ResponseTimeout("no response.done after response.cancel") from None
        if turn.error is not None:
            raise turn.error
        return turn.done

    async def close(self, *, timeout: float | None = None) -> SessionClosedEvent | None:
        """End the session: send ``session.close``, wait for ``session.closed``, close the socket.

        A reply in flight is cancelled by the server (its ``response.done`` still arrives).
        Safe to call twice, and after the server closed; never raises for a socket that is
        already gone.  Returns the ``session.closed`` event if one arrived.
        """
        wait = self._close_timeout if timeout is None else timeout
        self._user_closing = True
        try:
            if not self._ended.is_set() and self._fatal is None:
                with contextlib.suppress(ConnectionLost, SessionClosed):
                    await self._send(SessionCloseEvent(event_id=self._new_id()))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._ended.wait(), wait)
        finally:
            await self._shutdown(wait)
        return self.closed

    async def __aenter__(self) -> RealtimeSession:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ internals

    def _new_id(self) -> str:
        return f"sdk-{next(self._ids)}"

    def _resolve_timeout(self, timeout: _Timeout) -> float | None:
        if isinstance(timeout, _Default):
            return self._timeout
        return timeout

    def _frame_event(self, **fields: Any) -> FrameAppendEvent:
        try:
            return FrameAppendEvent(**fields)
        except ValidationError as exc:
            raise InvalidEvent(f"frame.append: {_first_error(exc)}") from None

    def _media_payload(self, data: bytes, binary: bool, common: dict[str, Any]) -> _Payload:
        media = sniff_media(data)
        if media is None:
            raise UndecodableFrame("payload is not JPEG, PNG, WebP, MP4 or WebM")
        limit = self.limits.max_frame_bytes
        if len(data) > limit:
            raise FrameTooLarge(f"payload is {len(data)} bytes; the server's limit is {limit}")
        if binary:
            return _Payload(self._frame_event(binary=True, **common), data)
        field = "video" if media in ("mp4", "webm") else "image"
        encoded = base64.b64encode(data).decode("ascii")
        return _Payload(self._frame_event(**{field: encoded}, **common))

    def _check_alive(self) -> None:
        """Raise why nothing can be sent: the session's end (or the socket's) as it happened;
        the machine refuses the rest (a closed session, a chunk in flight)."""
        closed = self.closed
        if closed is not None:
            raise SessionClosed(f"the session is closed ({closed.reason})") from self._fatal
        if self._fatal is not None:
            if isinstance(self._fatal, (RealtimeError, ConnectionLost)):
                raise self._fatal
            raise ConnectionLost(str(self._fatal)) from self._fatal
        if self._ended.is_set():
            raise ConnectionLost("the connection is closed")

    async def _send(self, *items: ClientEvent | bytes) -> None:
        """Send events (and a binary payload) back to back, each through the machine first."""
        self._check_alive()
        try:
            await self._transmit(self._ws, self._proto, items)
        except ConnectionClosed as exc:
            raise ConnectionLost(f"the connection closed while sending: {exc}") from None

    async def _transmit(
        self, ws: ClientConnection, proto: ClientProtocol, items: Sequence[ClientEvent | bytes]
    ) -> None:
        """Step ``proto`` and send each item on ``ws`` under the send lock (an announcement and
        its binary payload stay together); a refusal by the machine raises before the socket."""
        async with self._send_lock:
            if proto.state in (State.PARKED, State.PARKED_AWAITING_RESPONSE):
                # The server holds the session for a resume, which takes a new connection.
                raise ConnectionLost("the connection is gone; the session is being resumed")
            for item in items:
                if isinstance(item, bytes):
                    await ws.send(proto.send_binary(item))
                else:
                    await ws.send(encode_client_event(proto.send(item)))

    async def _wait(self, future: asyncio.Future[_T], timeout: float | None, what: str) -> _T:
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise ResponseTimeout(f"no {what} within {timeout} s") from None

    async def _start_turn(
        self, payload: _Payload, timeout: float | None
    ) -> tuple[_Turn, float | None]:
        """Send one chunk once the previous reply is done; return its turn and deadline."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        self._check_alive()
        async with self._turn_lock:
            event = payload.event.model_copy(update={"event_id": self._new_id()})
            previous = self._turn
            if previous is not None and not previous.finished.is_set() and previous.abandoned:
                # The caller gave up on it and the SDK cancelled it: its response.done is due.
                remaining = None if deadline is None else max(deadline - loop.time(), 0)
                try:
                    await asyncio.wait_for(previous.finished.wait(), remaining)
                except asyncio.TimeoutError:
                    raise ResponseTimeout(
                        f"the previous reply was still in flight after {timeout} s"
                    ) from None
            if self._ready.is_set():
                # One rule with the JS client (docs/protocol.md, "One chunk in flight"): no
                # hidden queue; a live source uses offer_frame, which drops instead.
                self._proto.check(event)
            else:  # reconnecting, or the server drains: wait for it
                remaining = None if deadline is None else max(deadline - loop.time(), 0)
                try:
                    await asyncio.wait_for(self._ready.wait(), remaining)
                except asyncio.TimeoutError:
                    raise ResponseTimeout(f"still reconnecting after {timeout} s") from None
            self._check_alive()
            self._proto.check(event)
            assert event.event_id is not None
            turn = _Turn(event.event_id, event.frame_id)
            self._turn = turn
            turn.items = [event] if payload.binary is None else [event, payload.binary]
            try:
                await self._send(*turn.items)
            except ConnectionLost:
                if not self.resilient:
                    turn.fail(ConnectionLost("the connection closed while sending"))
                    raise
                # The reader is reconnecting; it sends the chunk again unless it was accepted.
            except BaseException as exc:
                turn.fail(exc if isinstance(exc, Exception) else ConnectionLost("send aborted"))
                raise
        return turn, deadline

    async def _next_item(self, turn: _Turn, deadline: float | None) -> ServerEvent | BaseException:
        loop = asyncio.get_running_loop()
        remaining = None if deadline is None else max(deadline - loop.time(), 0)
        try:
            return await asyncio.wait_for(turn.events.get(), remaining)
        except asyncio.TimeoutError:
            turn.abandoned = True
            self._spawn(self._send_cancel(turn))
            raise ResponseTimeout("the reply did not finish in time; it was cancelled") from None
        except asyncio.CancelledError:
            # The caller gave up: stop the engine work, keep the session usable.
            if not turn.finished.is_set():
                turn.abandoned = True
                self._spawn(self._send_cancel(turn))
            raise

    async def _send_cancel(self, turn: _Turn) -> None:
        if turn.finished.is_set():
            return
        event_id = self._new_id()
        self._cancel_ids.add(event_id)
        with contextlib.suppress(ConnectionLost, SessionClosed, RealtimeError):
            await self._send(ResponseCancelEvent(event_id=event_id))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _shutdown(self, wait: float) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._ws.close(), wait)
        if not self._reader.done():
            self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        for task in list(self._background):
            task.cancel()
        self._end(ConnectionLost("the session was closed by the client"))

    # ------------------------------------------------------------------ the reader

    async def _read_loop(self) -> None:
        reason = "the server closed the connection without session.closed"
        try:
            while True:
                reason = await self._read_socket(self._ws)
                # The server parks a resumable session (a resume takes it over, with a new
                # machine) and ends any other.
                self._proto.connection_lost()
                if self._user_closing or not self.resilient or self._fatal is not None:
                    break
                if self.closed is not None:
                    break
                # Dropped: resume. Drained (or the resume is refused): a new session, unless
                # the server handed the session over (a session store): resume it elsewhere.
                handover = self.draining is not None and self.draining.handover
                if not await recovery.recover(self, fresh=self._moving and not handover):
                    reason = f"{reason}; reconnecting failed after {self._max_retries()} tries"
                    break
        finally:
            self._end(ConnectionLost(reason))

    async def _read_socket(self, ws: ClientConnection) -> str:
        """Dispatch the events of one socket until it ends; why it ended."""
        try:
            async for message in ws:
                if isinstance(message, bytes):
                    log.debug("ignoring a binary message from the server")
                    continue
                try:
                    event = parse_server_event(message)
                except ValidationError:
                    log.debug("ignoring a server message this client does not know")
                    continue
                self._dispatch(event)
        except ConnectionClosed as exc:
            return f"the connection broke: {exc}"
        return "the server closed the connection without session.closed"

    def _max_retries(self) -> int:
        return 0 if self._connector is None else self._connector.max_retries

    def _ack(self, turn: _Turn, frame_index: int) -> None:
        if turn.ack is None:
            turn.ack = InputAckEvent(frame_index=frame_index, frame_id=turn.frame_id, bytes=0)
            turn.events.put_nowait(turn.ack)

    async def _resend(self, turn: _Turn) -> None:
        """Send the turn's chunk again, through the (new) machine, on the (new) socket."""
        try:
            await self._transmit(self._ws, self._proto, turn.items)
        except RealtimeError as exc:  # the resumed session refuses it (e.g. a chunk in flight)
            turn.fail(exc)

    def _emit(self, event: ServerEvent) -> None:
        for queue in self._subscribers:
            queue.put_nowait(event)
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:
                log.exception("on_event callback failed")

    @staticmethod
    def _call_hook(hook: Callable[[_E], None] | None, event: _E) -> None:
        if hook is None:
            return
        try:
            hook(event)
        except Exception:
            log.exception("%s hook failed", event.type)

    def _end(self, exc: BaseException) -> None:
        """The socket is gone: fail whatever still waits."""
        if self._ended.is_set():
            return
        if self.closed is None and self._fatal is None:
            self._fatal = exc
        self._fail_pending(self._fatal or exc, include_acked=True)
        self._ended.set()
        for queue in self._subscribers:
            queue.put_nowait(None)

    def _fail_pending(self, exc: BaseException, *, include_acked: bool) -> None:
        if self._open_wait is not None and not self._open_wait[1].done():
            self._open_wait[1].set_exception(exc)
        turn = self._turn
        if turn is not None and (include_acked or turn.ack is None):
            turn.fail(exc)

    def _dispatch(self, event: ServerEvent) -> None:
        try:
            self._proto.receive(event)
        except InternalError as exc:  # the server broke the protocol's order: its bug
            log.error("server event out of order: %s", exc)
            self.errors.append(exc)
        self._emit(event)
        turn = self._turn
        if isinstance(event, InputAckEvent):
            if turn is not None and turn.ack is None and not turn.finished.is_set():
                turn.ack = event
                turn.events.put_nowait(event)
        elif isinstance(event, ResponseCreatedEvent):
            if turn is not None and turn.matches(event.frame_index):
                turn.created = event
                turn.events.put_nowait(event)
        elif isinstance(event, ResponseTextDeltaEvent):
            if turn is not None and turn.matches(event.frame_index):
                turn.events.put_nowait(event)
        elif isinstance(event, ResponseDoneEvent):
            if turn is not None and turn.matches(event.frame_index):
                turn.finish(event)
        elif isinstance(event, SessionOpenedEvent):
            if self._open_wait is not None and not self._open_wait[1].done():
                self._open_wait[1].set_result(event)
        elif isinstance(event, SessionUpdatedEvent):
            # session.updated answers the updates in the order they were sent.
            for future in self._update_waits.values():
                if not future.done():
                    future.set_result(event)
                    break
        elif isinstance(event, ServerDrainingEvent):
            self.draining = event
            if self.resilient:
                # Finish the reply in flight; new chunks wait for the next session.
                self._ready.clear()
        elif isinstance(event, SessionClosedEvent):
            self._closed = event
            if self.resilient and event.reason == "server_shutdown" and not self._user_closing:
                # The reader opens a new session (a new machine) once the socket ends.
                self._moving = True
                self._ready.clear()
                return
            ending = self._fatal or SessionClosed(f"the session was closed ({event.reason})")
            self._fail_pending(ending, include_acked=True)
        elif isinstance(event, ErrorEvent):
            self._on_error(event)

    def _on_error(self, event: ErrorEvent) -> None:
        detail = event.error
        exc = error_from_detail(detail)
        if not detail.session_survives:
            # session.closed follows; an accepted chunk still gets its response.done first.
            self._fatal = exc
            self._fail_pending(exc, include_acked=False)
            return
        if self._open_wait is not None and detail.event_id == self._open_wait[0]:
            if not self._open_wait[1].done():
                self._open_wait[1].set_exception(exc)
            return
        waiting = self._update_waits.get(detail.event_id or "")
        if waiting is not None:
            if not waiting.done():
                waiting.set_exception(exc)
            return
        turn = self._turn
        if (
            turn is not None
            and detail.event_id == turn.event_id
            and turn.ack is None
            and not turn.finished.is_set()
        ):
            turn.fail(exc)
            return
        if detail.event_id in self._cancel_ids:
            self._cancel_ids.discard(detail.event_id)
            if detail.code == "no_response_in_flight":  # the reply finished first
                return
        log.info("server error answering no pending call: %s", exc)
        self.errors.append(exc)


# ---------------------------------------------------------------------- connect


class Connector:
    """What :func:`connect` returns: await it, or use it as ``async with``."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None,
        auth: AuthMethod,
        config: SessionConfig | Mapping[str, Any] | None,
        open_timeout: float,
        timeout: float | None,
        close_timeout: float,
        on_event: Callable[[ServerEvent], None] | None,
        max_retries: int = 8,
        retry_backoff: float = 0.5,
        on_resumed: Callable[[SessionResumedEvent], None] | None = None,
        on_reopened: Callable[[SessionOpenedEvent], None] | None = None,
    ) -> None:
        if auth not in ("header", "subprotocol"):
            raise ValueError(f"auth must be 'header' or 'subprotocol', not {auth!r}")
        self.url = url
        self.api_key = api_key
        self.auth = auth
        self.config = config
        self.open_timeout = open_timeout
        self.timeout = timeout
        self.close_timeout = close_timeout
        self.on_event = on_event
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.on_resumed = on_resumed
        self.on_reopened = on_reopened
        self._session: RealtimeSession | None = None

    def __await__(self) -> Generator[Any, None, RealtimeSession]:
        return self._connect().__await__()

    async def __aenter__(self) -> RealtimeSession:
        self._session = await self._connect()
        return self._session

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()

    async def _connect(self) -> RealtimeSession:
        ws, greeting = await self._handshake()
        session = RealtimeSession(
            ws,
            greeting,
            timeout=self.timeout,
            close_timeout=self.close_timeout,
            on_event=self.on_event,
            connector=self,
            on_resumed=self.on_resumed,
            on_reopened=self.on_reopened,
        )
        if self.config is not None:
            try:
                await session.open(self.config)
            except BaseException:
                await session.close()
                raise
        return session

    async def _handshake(self) -> tuple[ClientConnection, SessionCreatedEvent]:
        """Open the WebSocket and read the greeting."""
        subprotocols = [Subprotocol(SUBPROTOCOL)]
        headers: dict[str, str] = {}
        if self.api_key:
            if self.auth == "header":
                headers["Authorization"] = f"Bearer {self.api_key}"
            else:
                subprotocols.append(Subprotocol(AUTH_SUBPROTOCOL_PREFIX + self.api_key))
        try:
            ws = await ws_connect(
                self.url,
                subprotocols=subprotocols,
                additional_headers=headers or None,
                open_timeout=self.open_timeout,
                close_timeout=self.close_timeout,
                compression=None,  # JPEG does not deflate; don't spend CPU trying
                max_size=16 * 1024 * 1024,
            )
        except InvalidStatus as exc:
            status = exc.response.status_code
            if status in (401, 403):
                raise Unauthorized(
                    f"the server refused the handshake (HTTP {status}): missing or wrong API key"
                ) from None
            raise ConnectError(f"the server refused the handshake (HTTP {status})") from None
        except (OSError, InvalidHandshake, asyncio.TimeoutError) as exc:
            raise ConnectError(f"cannot connect to {self.url}: {exc!r}") from exc
        try:
            if ws.subprotocol != SUBPROTOCOL:
                raise ConnectError(f"the server did not select the {SUBPROTOCOL!r} subprotocol")
            try:
                raw = await asyncio.wait_for(ws.recv(), self.open_timeout)
                greeting = parse_server_event(raw)
            except (ConnectionClosed, asyncio.TimeoutError, ValidationError) as exc:
                raise ConnectError(f"no session.created from the server: {exc!r}") from None
            if isinstance(greeting, ErrorEvent):
                raise error_from_detail(greeting.error)
            if not isinstance(greeting, SessionCreatedEvent):
                raise ConnectError(f"expected session.created, got {greeting.type}")
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), self.close_timeout)
            raise
        return ws, greeting


def connect(
    url: str,
    *,
    api_key: str | None = None,
    auth: AuthMethod = "header",
    config: SessionConfig | Mapping[str, Any] | None = None,
    open_timeout: float = 10.0,
    timeout: float | None = 60.0,
    close_timeout: float = 5.0,
    on_event: Callable[[ServerEvent], None] | None = None,
    max_retries: int = 8,
    retry_backoff: float = 0.5,
    on_resumed: Callable[[SessionResumedEvent], None] | None = None,
    on_reopened: Callable[[SessionOpenedEvent], None] | None = None,
) -> Connector:
    """Connect to a vllm-realtime server; ``await`` it or use ``async with``.

    :param url: the WebSocket endpoint, e.g. ``ws://127.0.0.1:8000/v1/realtime``.
    :param api_key: the server's API key, if it has one.  A wrong key raises
        :class:`~vllm_realtime_protocol.errors.Unauthorized`.
    :param auth: ``"header"`` sends ``Authorization: Bearer``; ``"subprotocol"`` sends the
        ``vllm-realtime.auth.<key>`` subprotocol (what browsers must do).
    :param config: if given, the session is opened with it before ``connect`` returns
        (otherwise call :meth:`RealtimeSession.open`).
    :param open_timeout: seconds for the handshake and the greeting.
    :param timeout: default seconds per call (a whole reply, from send to ``response.done``);
        None waits forever.  Each call takes its own ``timeout=`` too.
    :param close_timeout: seconds :meth:`RealtimeSession.close` waits for ``session.closed``.
    :param on_event: called with every server event, in order (for logging or UIs); it must
        not block.
    :param max_retries: connection attempts a resilient session (opened with ``resumable``)
        makes to resume or reopen before it gives up with :class:`ConnectionLost`.
    :param retry_backoff: seconds before the second attempt; doubled each time, up to 8 s.
    :param on_resumed: called when a resilient session resumed on a new connection (its
        context intact).
    :param on_reopened: called when a resilient session could not be resumed and a NEW session
        with the same settings replaced it (after a drain, or a refused resume): the context the
        old one held is gone.  Without this hook a reopen is logged as a warning.
    """
    return Connector(
        url,
        api_key=api_key,
        auth=auth,
        config=config,
        open_timeout=open_timeout,
        timeout=timeout,
        close_timeout=close_timeout,
        on_event=on_event,
        max_retries=max_retries,
        retry_backoff=retry_backoff,
        on_resumed=on_resumed,
        on_reopened=on_reopened,
    )
