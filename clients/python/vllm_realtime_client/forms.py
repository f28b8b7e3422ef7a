"""The session's one-line forms: every chunk call is :meth:`RealtimeSession.stream` with some
keywords fixed (and ``.result()`` to wait for the ``response.done``); the read-only views read
the protocol machine.  The names are the SDK's public surface from before ``stream``: tests and
users call them, so they stay, each a form of the few verbs :class:`RealtimeSession` has.
"""

from __future__ import annotations

import asyncio
import enum
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict

from vllm_realtime_protocol.events import (
    Limits,
    ResponseDoneEvent,
    ResponseFormat,
    SessionConfig,
    SessionCreatedEvent,
    SessionOpenedEvent,
)

if TYPE_CHECKING:  # typing.Unpack is 3.11+; annotations are not evaluated at run time
    from typing import Unpack

    from vllm_realtime_client.session import Connector, ResponseStream
    from vllm_realtime_protocol.client import ClientProtocol

__all__ = ["SessionForms"]


class _Default(enum.Enum):
    """Sentinel type: "use the session's default timeout"."""

    TOKEN = 0


_DEFAULT = _Default.TOKEN
_Timeout: TypeAlias = "float | _Default | None"


class _FrameOptions(TypedDict, total=False):
    """The keywords of :meth:`RealtimeSession.stream`, for the forms that pass them all on."""

    prompt: str | None
    frame_id: str | None
    timestamp: float | None
    binary: bool
    reply: bool
    response_format: ResponseFormat | dict[str, Any] | None
    timeout: _Timeout


class SessionForms:
    """The old names of :class:`~vllm_realtime_client.session.RealtimeSession`, as forms of its
    verbs (mixed into it; not used alone)."""

    if TYPE_CHECKING:  # what the forms read of the session
        _proto: ClientProtocol
        _connector: Connector | None
        _created: SessionCreatedEvent
        _opened: SessionOpenedEvent | None
        _ready: asyncio.Event
        _ended: asyncio.Event
        _fatal: BaseException | None
        dropped: int

        @property
        def busy(self) -> bool: ...

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
        ) -> ResponseStream: ...

    # ------------------------------------------------------------------ views of the machine

    @property
    def created(self) -> SessionCreatedEvent:
        """The server's greeting (on the current connection)."""
        return self._created

    @property
    def opened(self) -> SessionOpenedEvent | None:
        """The ``session.opened`` answer, once :meth:`open` succeeded (its config the one the
        server last confirmed)."""
        opened, config = self._opened, self._proto.config
        if opened is None or config is None or opened.config is config:
            return opened
        return opened.model_copy(update={"config": config})

    @property
    def config(self) -> SessionConfig | None:
        """The effective session settings (defaults filled, caps applied), once open."""
        return self._proto.config

    @property
    def limits(self) -> Limits:
        """What the server allows (frame size, idle timeout, max_tokens cap, model)."""
        return self._proto.limits or self._created.limits

    @property
    def is_closed(self) -> bool:
        """True once the session ended (closed by either side, or the socket went away)."""
        return self._ended.is_set() or self._fatal is not None

    @property
    def resilient(self) -> bool:
        """Whether the session resumes after a drop and moves on after a drain (it was opened
        with ``resumable`` and the server granted it)."""
        return self._proto.resume_token is not None and self._connector is not None

    # ------------------------------------------------------------------ forms of stream()

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
        """Send one image or clip and stream its reply (:meth:`stream` with bytes)."""
        return self.stream(
            data,
            prompt=prompt,
            frame_id=frame_id,
            timestamp=timestamp,
            binary=binary,
            reply=reply,
            response_format=response_format,
            timeout=timeout,
        )

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
        """Send one image or clip and return its ``response.done`` (see :meth:`stream`).

        A reply that ended badly is still returned: check ``done.status`` (``completed``,
        ``incomplete``, ``cancelled``, ``failed``).
        """
        return await self.stream(
            data,
            prompt=prompt,
            frame_id=frame_id,
            timestamp=timestamp,
            binary=binary,
            response_format=response_format,
            timeout=timeout,
        ).result()

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
        return await self.stream(
            data,
            frame_id=frame_id,
            timestamp=timestamp,
            binary=binary,
            reply=False,
            timeout=timeout,
        ).result()

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
        return self.stream(
            question,
            response_format=response_format,
            frame_id=frame_id,
            timestamp=timestamp,
            timeout=timeout,
        )

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
        return await self.stream(
            question,
            response_format=response_format,
            frame_id=frame_id,
            timestamp=timestamp,
            timeout=timeout,
        ).result()

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
        return self.stream(
            text, prompt=prompt, frame_id=frame_id, timestamp=timestamp, timeout=timeout
        )

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
        return await self.stream(
            text, prompt=prompt, frame_id=frame_id, timestamp=timestamp, timeout=timeout
        ).result()

    # ------------------------------------------------------------------ pacing a live source

    async def offer_frame(
        self,
        data: bytes | Callable[[], bytes | Awaitable[bytes]],
        **options: Unpack[_FrameOptions],
    ) -> ResponseDoneEvent | None:
        """Send a frame if no chunk is in flight, else drop it and return None: how a live
        source paces itself (the JS client's ``offerFrame``; nothing queues, so latency stays
        one reply).  ``data`` may be a callable, so a frame is only captured or encoded when
        it will be sent.  Drops are counted in :attr:`dropped`.  The keywords are
        :meth:`stream`'s (``prompt``, ``frame_id``, ``timestamp``, ``binary``,
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
        return await self.stream(payload, **options).result()

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
