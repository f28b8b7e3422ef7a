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
import enum
import itertools
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypedDict, TypeVar

from pydantic import BaseModel, ValidationError
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from vllm_realtime_client.errors import (
    ChunkInFlight,
    ConnectError,
    ConnectionLost,
    FrameTooLarge,
    InvalidEvent,
    RealtimeError,
    ResponseTimeout,
    SessionAlreadyOpen,
    SessionClosed,
    SessionNotOpen,
    Unauthorized,
    UndecodableFrame,
    error_from_detail,
)
from vllm_realtime_protocol.codec import encode_client_event, parse_server_event, sniff_media
from vllm_realtime_protocol.constants import AUTH_SUBPROTOCOL_PREFIX, SUBPROTOCOL
from vllm_realtime_protocol.events import (
    ChunkLimits,
    ErrorEvent,
    FrameAppendEvent,
    FrameFormat,
    InputAckEvent,
    Limits,
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
    SessionResumeEvent,
    SessionUpdatedEvent,
    SessionUpdateEvent,
)

__all__ = ["AuthMethod", "Connector", "RealtimeSession", "ResponseStream", "connect"]

log = logging.getLogger("vllm_realtime_client")

AuthMethod: TypeAlias = Literal["header", "subprotocol"]
"""How the API key travels: ``Authorization: Bearer`` (default) or the auth subprotocol."""

_MAX_KEPT_ERRORS = 64
_T = TypeVar("_T")
_E = TypeVar("_E", SessionResumedEvent, SessionOpenedEvent)


class _Default(enum.Enum):
    """Sentinel type: "use the session's default timeout"."""

    TOKEN = 0


_DEFAULT = _Default.TOKEN
_Timeout: TypeAlias = "float | _Default | None"

if TYPE_CHECKING:  # typing.Unpack is 3.11+; annotations are not evaluated at run time
    from typing import Unpack


class _FrameOptions(TypedDict, total=False):
    """The keywords of :meth:`RealtimeSession.stream_frame`, once, for the methods that take
    them all and pass them on (:meth:`RealtimeSession.offer_frame`)."""

    prompt: str | None
    frame_id: str | None
    timestamp: float | None
    binary: bool
    reply: bool
    response_format: ResponseFormat | dict[str, Any] | None
    timeout: _Timeout


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
        self.messages: list[str | bytes] = []
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


class RealtimeSession:
    """A connection to ``/v1/realtime`` and its one session.  Made by :func:`connect`.

    Calls are coroutines; concurrent ``append_*`` calls are sent one at a time, each after the
    previous reply's ``response.done`` (the protocol allows one chunk in flight).  A live
    source should not queue frames here: check :attr:`busy` and drop frames instead.
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
        self._connector = connector
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
        """Frames :meth:`offer_frame` dropped because a chunk was in flight (or the session was
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
        self.errors: deque[RealtimeError] = deque(maxlen=_MAX_KEPT_ERRORS)
        """Surviving ``error`` events that answered no pending call (newest last)."""
        # Resilience (resumable sessions): the token, the index the next accepted chunk gets,
        # whether chunks may be sent now (cleared while reconnecting or draining).
        self._resume_token: str | None = None
        self._next_index = 0
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
    def session_id(self) -> str:
        """The session's id (from ``session.opened``, ``session.resumed`` or the greeting)."""
        return self._opened.session_id if self._opened is not None else self._created.session_id

    @property
    def resilient(self) -> bool:
        """Whether the session resumes after a drop and moves on after a drain (it was opened
        with ``resumable`` and the server granted it)."""
        return self._resume_token is not None and self._connector is not None

    @property
    def created(self) -> SessionCreatedEvent:
        """The server's greeting."""
        return self._created

    @property
    def opened(self) -> SessionOpenedEvent | None:
        """The ``session.opened`` answer, once :meth:`open` succeeded."""
        return self._opened

    @property
    def config(self) -> SessionConfig | None:
        """The effective session settings (defaults filled, caps applied), once open."""
        return None if self._opened is None else self._opened.config

    @property
    def limits(self) -> Limits:
        """What the server allows (frame size, idle timeout, max_tokens cap, model)."""
        return self._opened.limits if self._opened is not None else self._created.limits

    @property
    def busy(self) -> bool:
        """True while a chunk is in flight (sent, its ``response.done`` not yet received)."""
        return self._turn is not None and not self._turn.finished.is_set()

    @property
    def closed(self) -> SessionClosedEvent | None:
        """The ``session.closed`` event, once the session ended."""
        return self._closed

    @property
    def is_closed(self) -> bool:
        """True once the session ended (closed by either side, or the socket went away)."""
        return self._ended.is_set() or self._fatal is not None

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
        if self._opened is not None or self._open_wait is not None:
            raise SessionAlreadyOpen("open() was already called on this session")
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
        future: asyncio.Future[SessionOpenedEvent] = asyncio.get_running_loop().create_future()
        self._open_wait = (event_id, future)
        try:
            await self._send(encode_client_event(event))
            opened = await self._wait(future, self._resolve_timeout(timeout), "session.opened")
        finally:
            self._open_wait = None
        self._opened = opened
        self._resume_token = opened.resume_token
        self._next_index = 0
        return opened

    def stream_frame(
        self,
        data: bytes,
        *,
        prompt: str | None = None,
        frame_id: str | None = None,
        timestamp: float | None = None,
        binary: bool = True,
        reply: bool = True,
        response_format: ResponseFormat | dict[str, Any] | None = None,
        timeout: _Timeout = _DEFAULT,
    ) -> ResponseStream:
        """Send one image (JPEG/PNG/WebP) or clip (MP4/WebM) and stream its reply.

        ``reply=False`` only prefills it (see :meth:`ingest_frame`); ``response_format``
        constrains this reply (OpenAI's shape), overriding the session's.

        ``binary=True`` (default) sends the bytes as a binary WebSocket message after a
        ``frame.append`` with ``"binary": true``; ``binary=False`` sends base64 inside the JSON.
        Size and format are checked here first (:class:`~vllm_realtime_protocol.errors.FrameTooLarge`,
        :class:`~vllm_realtime_protocol.errors.UndecodableFrame`), without a round trip.
        """
        media = sniff_media(data)
        if media is None:
            raise UndecodableFrame("payload is not JPEG, PNG, WebP, MP4 or WebM")
        limit = self.limits.max_frame_bytes
        if len(data) > limit:
            raise FrameTooLarge(f"payload is {len(data)} bytes; the server's limit is {limit}")
        common: dict[str, Any] = {"prompt": prompt, "frame_id": frame_id, "timestamp": timestamp}
        if not reply:
            common["reply"] = False
        if response_format is not None:
            common["response_format"] = response_format
        if binary:
            payload = _Payload(self._frame_event(binary=True, **common), data)
        else:
            field = "video" if media in ("mp4", "webm") else "image"
            encoded = base64.b64encode(data).decode("ascii")
            payload = _Payload(self._frame_event(**{field: encoded}, **common))
        return ResponseStream(self, payload, self._resolve_timeout(timeout))

    async def append_frame(
        self,
        data: bytes,
        *,
        prompt: str | None = None,
        frame_id: str | None = None,
        timestamp: float | None = None,
        binary: bool = True,
        response_format: ResponseFormat | dict[str, Any] | None = None,
        timeout: _Timeout = _DEFAULT,
    ) -> ResponseDoneEvent:
        """Send one image or clip and return its ``response.done`` (see :meth:`stream_frame`).

        A reply that ended badly is still returned: check ``done.status`` (``completed``,
        ``incomplete``, ``cancelled``, ``failed``).
        """
        stream = self.stream_frame(
            data,
            prompt=prompt,
            frame_id=frame_id,
            timestamp=timestamp,
            binary=binary,
            response_format=response_format,
            timeout=timeout,
        )
        return await stream.result()

    async def ingest_frame(
        self,
        data: bytes,
        *,
        frame_id: str | None = None,
        timestamp: float | None = None,
        binary: bool = True,
        timeout: _Timeout = _DEFAULT,
    ) -> ResponseDoneEvent:
        """Watch one image or clip without a reply (``frame.append`` with ``reply: false``).

        The frame is prefilled into the session's context and nothing is generated; the
        ``response.done`` comes with ``status == "ingested"`` (empty text, no
        ``response.created``, no deltas). Ask about what was watched with :meth:`ask`.
        """
        stream = self.stream_frame(
            data,
            frame_id=frame_id,
            timestamp=timestamp,
            binary=binary,
            reply=False,
            timeout=timeout,
        )
        return await stream.result()

    def stream_ask(
        self,
        question: str,
        *,
        response_format: ResponseFormat | dict[str, Any] | None = None,
        frame_id: str | None = None,
        timestamp: float | None = None,
        timeout: _Timeout = _DEFAULT,
    ) -> ResponseStream:
        """Ask a question between frames (a ``text`` chunk, also in ``"video"`` sessions) and
        stream the answer. ``response_format`` constrains this answer, overriding the session's."""
        fields: dict[str, Any] = {"text": question, "frame_id": frame_id, "timestamp": timestamp}
        if response_format is not None:
            fields["response_format"] = response_format
        event = self._frame_event(**fields)
        return ResponseStream(self, _Payload(event), self._resolve_timeout(timeout))

    async def ask(
        self,
        question: str,
        *,
        response_format: ResponseFormat | dict[str, Any] | None = None,
        frame_id: str | None = None,
        timestamp: float | None = None,
        timeout: _Timeout = _DEFAULT,
    ) -> ResponseDoneEvent:
        """Ask a question about what the session holds and return its ``response.done``
        (the answer is ``done.text``; see :meth:`stream_ask`)."""
        stream = self.stream_ask(
            question,
            response_format=response_format,
            frame_id=frame_id,
            timestamp=timestamp,
            timeout=timeout,
        )
        return await stream.result()

    def stream_text(
        self,
        text: str,
        *,
        prompt: str | None = None,
        frame_id: str | None = None,
        timestamp: float | None = None,
        timeout: _Timeout = _DEFAULT,
    ) -> ResponseStream:
        """Send one text turn and stream its reply (in a ``"video"`` session it is a question
        about what the window holds; see :meth:`ask`)."""
        event = self._frame_event(text=text, prompt=prompt, frame_id=frame_id, timestamp=timestamp)
        return ResponseStream(self, _Payload(event), self._resolve_timeout(timeout))

    async def append_text(
        self,
        text: str,
        *,
        prompt: str | None = None,
        frame_id: str | None = None,
        timestamp: float | None = None,
        timeout: _Timeout = _DEFAULT,
    ) -> ResponseDoneEvent:
        """Send one text turn and return its ``response.done``."""
        stream = self.stream_text(
            text, prompt=prompt, frame_id=frame_id, timestamp=timestamp, timeout=timeout
        )
        return await stream.result()

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
        if self._opened is None:
            raise SessionNotOpen("call open() before update()")
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
            await self._send(encode_client_event(event))
            return await self._wait(future, self._resolve_timeout(timeout), "session.updated")
        finally:
            del self._update_waits[event_id]

    async def offer_frame(
        self,
        data: bytes | Callable[[], bytes | Awaitable[bytes]],
        **options: Unpack[_FrameOptions],
    ) -> ResponseDoneEvent | None:
        """Send a frame if no chunk is in flight, else drop it and return None: how a live
        source paces itself (the JS client's ``offerFrame``; nothing queues, so latency stays
        one reply).  ``data`` may be a callable, so a frame is only captured or encoded when
        it will be sent.  Drops are counted in :attr:`dropped`.  The keywords are
        :meth:`stream_frame`'s (``prompt``, ``frame_id``, ``timestamp``, ``binary``,
        ``reply``, ``response_format``, ``timeout``)."""
        if self.busy or not self._ready.is_set():
            self.dropped += 1
            return None
        payload = data() if callable(data) else data
        if not isinstance(payload, bytes):
            payload = await payload
        if self.busy or not self._ready.is_set():  # taken while the frame was being made
            self.dropped += 1
            return None
        return await self.stream_frame(payload, **options).result()

    async def stream_video(
        self,
        source: str | os.PathLike[str],
        *,
        fps: float = 1.0,
        prompt: str | None = None,
        reply_every: int = 1,
        width: int | None = None,
        height: int | None = None,
        realtime: bool = True,
        max_frames: int | None = None,
        timeout: _Timeout = _DEFAULT,
    ) -> AsyncIterator[ResponseDoneEvent]:
        """Stream a video file (or any URL FFmpeg opens) into the session as JPEG frames, one
        every ``1/fps`` seconds of video time, and yield each ``response.done``.

        ``realtime=True`` plays the video at its own pace and offers each frame when it is
        due: a frame due while a reply is still running is dropped (counted in
        :attr:`dropped`), as a live camera would be.  ``realtime=False`` sends every sampled
        frame, each after the previous reply.  Every ``reply_every``-th frame is answered
        (with ``prompt``); the others are only watched (status ``ingested``).  Needs PyAV
        (``pip install 'vllm-realtime-client[video]'``)."""
        from vllm_realtime_client.video import sample_jpegs

        if reply_every < 1:
            raise ValueError(f"reply_every must be >= 1, got {reply_every}")
        frames = sample_jpegs(source, fps=fps, width=width, height=height)
        loop = asyncio.get_running_loop()
        start = loop.time()
        pending: asyncio.Task[ResponseDoneEvent | None] | None = None
        for number, (at, jpeg) in enumerate(frames):
            if max_frames is not None and number >= max_frames:
                break
            if realtime:
                await asyncio.sleep(max(0.0, start + at - loop.time()))
            elif pending is not None:
                await asyncio.wait([pending])
            if pending is not None and pending.done():
                finished, pending = pending.result(), None
                if finished is not None:
                    yield finished
            answer = number % reply_every == reply_every - 1
            offer = self.offer_frame(
                jpeg,
                prompt=prompt if answer else None,
                frame_id=f"video-{number}",
                timestamp=at,
                reply=answer,
                timeout=timeout,
            )
            if pending is not None:  # still busy: this frame's moment has passed
                offer.close()
                self.dropped += 1
                continue
            pending = asyncio.ensure_future(offer)
        if pending is not None:
            finished = await pending
            if finished is not None:
                yield finished

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
                    await self._send(
                        encode_client_event(SessionCloseEvent(event_id=self._new_id()))
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._ended.wait(), wait)
        finally:
            await self._shutdown(wait)
        return self._closed

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

    def _check_alive(self) -> None:
        if self._closed is not None:
            raise SessionClosed(f"the session is closed ({self._closed.reason})") from self._fatal
        if self._fatal is not None:
            if isinstance(self._fatal, (RealtimeError, ConnectionLost)):
                raise self._fatal
            raise ConnectionLost(str(self._fatal)) from self._fatal
        if self._ended.is_set():
            raise ConnectionLost("the connection is closed")

    async def _send(self, *messages: str | bytes) -> None:
        """Send messages back to back (an announcement and its binary payload stay together)."""
        self._check_alive()
        async with self._send_lock:
            try:
                for message in messages:
                    await self._ws.send(message)
            except ConnectionClosed as exc:
                raise ConnectionLost(f"the connection closed while sending: {exc}") from None

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
        if self._opened is None:
            raise SessionNotOpen("call open() before sending chunks")
        async with self._turn_lock:
            previous = self._turn
            if previous is not None and not previous.finished.is_set() and not previous.abandoned:
                # One rule with the JS client (docs/protocol.md, "One chunk in flight"): no
                # hidden queue; a live source uses offer_frame, which drops instead.
                raise ChunkInFlight(
                    "a chunk is already in flight; wait for its response.done "
                    "(or use offer_frame, which drops frames while busy)"
                )
            if previous is not None and not previous.finished.is_set():
                remaining = None if deadline is None else max(deadline - loop.time(), 0)
                try:
                    await asyncio.wait_for(previous.finished.wait(), remaining)
                except asyncio.TimeoutError:
                    raise ResponseTimeout(
                        f"the previous reply was still in flight after {timeout} s"
                    ) from None
            if not self._ready.is_set():  # reconnecting, or the server drains: wait for it
                remaining = None if deadline is None else max(deadline - loop.time(), 0)
                try:
                    await asyncio.wait_for(self._ready.wait(), remaining)
                except asyncio.TimeoutError:
                    raise ResponseTimeout(f"still reconnecting after {timeout} s") from None
            self._check_alive()
            event = payload.event.model_copy(update={"event_id": self._new_id()})
            assert event.event_id is not None
            turn = _Turn(event.event_id, event.frame_id)
            self._turn = turn
            messages: list[str | bytes] = [encode_client_event(event)]
            if payload.binary is not None:
                messages.append(payload.binary)
            turn.messages = messages
            try:
                await self._send(*messages)
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
            await self._send(encode_client_event(ResponseCancelEvent(event_id=event_id)))

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
                if self._user_closing or not self.resilient or self._fatal is not None:
                    break
                if self._closed is not None and not self._moving:
                    break
                # Dropped: resume. Drained (or the resume is refused): a new session, unless
                # the server handed the session over (a session store): resume it elsewhere.
                handover = self.draining is not None and self.draining.handover
                if not await self._recover(fresh=self._moving and not handover):
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

    # ------------------------------------------------------------------ resilience

    def _max_retries(self) -> int:
        return 0 if self._connector is None else self._connector.max_retries

    async def _recover(self, *, fresh: bool) -> bool:
        """Reconnect: resume the session, or (``fresh``, or the resume refused) open a new one
        with the same settings. At most ``max_retries`` connection attempts, with backoff."""
        connector = self._connector
        assert connector is not None and self._opened is not None
        self._ready.clear()
        delay = connector.retry_backoff
        for attempt in range(connector.max_retries):
            if attempt:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 8.0)
            if self._user_closing:
                return False
            try:
                ws, greeting = await connector._handshake()
            except Unauthorized:
                return False  # the key (or secret) is no longer good: retrying will not help
            except (ConnectError, RealtimeError) as exc:
                log.info("reconnect attempt %d failed: %s", attempt + 1, exc)
                continue
            try:
                if not fresh:
                    resumed = await self._exchange(ws, self._resume_event(), SessionResumedEvent)
                    if isinstance(resumed, SessionResumedEvent):
                        await self._adopt(ws, greeting, resumed)
                        return True
                    log.info("session.resume refused (%s): opening a new session", resumed)
                    fresh = True
                    with contextlib.suppress(Exception):
                        await ws.close()
                    delay = connector.retry_backoff
                    continue  # the refusal ended that connection; open on a new one
                opened = await self._exchange(ws, self._reopen_event(), SessionOpenedEvent)
                if isinstance(opened, SessionOpenedEvent):
                    await self._adopt(ws, greeting, opened)
                    return True
                log.info("reopening refused (%s); retrying", opened)
            except (ConnectionClosed, asyncio.TimeoutError, OSError) as exc:
                log.info("reconnect attempt %d broke: %r", attempt + 1, exc)
            with contextlib.suppress(Exception):
                await ws.close()
        return False

    def _resume_event(self) -> SessionResumeEvent:
        assert self._resume_token is not None
        return SessionResumeEvent(
            event_id=self._new_id(), session_id=self.session_id, resume_token=self._resume_token
        )

    def _reopen_event(self) -> SessionOpenEvent:
        assert self._opened is not None
        config = self._opened.config
        fields = {name: getattr(config, name) for name in SessionConfig.model_fields}
        return SessionOpenEvent(event_id=self._new_id(), **fields)

    async def _exchange(
        self, ws: ClientConnection, event: SessionResumeEvent | SessionOpenEvent, want: type[_T]
    ) -> _T | str:
        """Send one event on a fresh socket and read up to its answer: the answer, or the code
        of the error that refused it."""
        await ws.send(encode_client_event(event))
        assert self._connector is not None
        while True:
            raw = await asyncio.wait_for(ws.recv(), self._connector.open_timeout)
            if isinstance(raw, bytes):
                continue
            answer = parse_server_event(raw)
            if isinstance(answer, want):
                return answer
            if isinstance(answer, ErrorEvent):
                return answer.error.code
            if isinstance(answer, SessionClosedEvent):  # e.g. the server drains
                return f"session.closed ({answer.reason})"

    async def _adopt(
        self,
        ws: ClientConnection,
        greeting: SessionCreatedEvent,
        answer: SessionResumedEvent | SessionOpenedEvent,
    ) -> None:
        """Carry on with the session on ``ws``; finish or resend the chunk in flight."""
        old, self._ws = self._ws, ws
        with contextlib.suppress(Exception):
            await asyncio.wait_for(old.close(), 1.0)
        self._created = greeting
        self._closed = None
        self._moving = False
        self.draining = None
        turn = self._turn
        pending = turn is not None and not turn.finished.is_set()
        expected = self._next_index if turn is None or turn.ack is None else turn.ack.frame_index
        if isinstance(answer, SessionResumedEvent):
            self.resumes += 1
            self._resume_token = answer.resume_token
            self._opened = SessionOpenedEvent(
                session_id=answer.session_id,
                config=answer.config,
                limits=answer.limits,
                resume_token=answer.resume_token,
            )
            self._next_index = answer.next_frame_index
            self._emit(answer)
            self._call_hook(self._on_resumed, answer)
            if pending:
                assert turn is not None
                missed = answer.missed_response
                if missed is not None and missed.frame_index == expected:
                    self._ack(turn, expected)
                    turn.finish(missed)
                    self._next_index = max(self._next_index, expected + 1)
                elif answer.in_flight_frame_index == expected:
                    self._ack(turn, expected)  # the rest of the reply comes on this socket
                elif turn.ack is None:
                    await self._resend(turn)
                elif answer.next_frame_index == expected and not turn.resent:
                    # Accepted, then lost with its server (the store is at the last
                    # response.done): the resumed session expects this chunk again. Once: a
                    # chunk that kills servers must not kill the fleet.
                    turn.resent = True
                    self.chunks_resent += 1
                    log.warning(
                        "the reply to chunk %d was lost with its server; sending the chunk "
                        "again to the resumed session",
                        expected,
                    )
                    await self._resend(turn)
                else:
                    turn.fail(ConnectionLost("the reply in flight was lost with its server"))
        else:
            self.generation += 1
            self._opened = answer
            self._resume_token = answer.resume_token
            self._next_index = 0
            self._emit(answer)
            if self._on_reopened is None:
                # Never silent: the context the old session held is gone.
                log.warning(
                    "session could not be resumed: new session %s (generation %d) replaced it; "
                    "its context is lost (pass on_reopened= to handle this)",
                    answer.session_id[:12],
                    self.generation,
                )
            self._call_hook(self._on_reopened, answer)
            if pending:
                assert turn is not None
                if turn.ack is None:
                    await self._resend(turn)  # never accepted: it goes to the new session
                else:
                    turn.fail(ConnectionLost("the reply in flight was lost with the session"))
        self._ready.set()
        log.info(
            "session %s on a new connection (%s)",
            self.session_id[:12],
            "resumed" if isinstance(answer, SessionResumedEvent) else "new session",
        )

    def _ack(self, turn: _Turn, frame_index: int) -> None:
        if turn.ack is None:
            turn.ack = InputAckEvent(frame_index=frame_index, frame_id=turn.frame_id, bytes=0)
            turn.events.put_nowait(turn.ack)

    async def _resend(self, turn: _Turn) -> None:
        async with self._send_lock:
            for message in turn.messages:
                await self._ws.send(message)

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
        if self._closed is None and self._fatal is None:
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
        self._emit(event)
        turn = self._turn
        if isinstance(event, InputAckEvent):
            self._next_index = event.frame_index + 1
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
            if self._opened is not None:
                self._opened = self._opened.model_copy(update={"config": event.config})
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
            if self.resilient and event.reason == "server_shutdown" and not self._user_closing:
                self._moving = True  # the reader opens a new session once the socket ends
                return
            self._closed = event
            exc = self._fatal or SessionClosed(f"the session was closed ({event.reason})")
            self._fail_pending(exc, include_acked=True)
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
