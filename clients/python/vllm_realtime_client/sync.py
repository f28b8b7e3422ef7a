"""A small blocking wrapper over the asyncio client, for scripts and notebooks.

::

    from vllm_realtime_client.sync import connect

    with connect("ws://127.0.0.1:8000/v1/realtime") as session:
        session.open(instructions="Describe each frame.")
        for delta in (stream := session.stream_frame(jpeg)):
            print(delta.delta, end="")
        print(stream.done.status)

The asyncio session runs on a private event loop in a daemon thread; every call blocks until
its coroutine finishes there.  Exceptions are the same as the async client's.  A
``KeyboardInterrupt`` while a call waits cancels that call (the reply in flight is cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

from vllm_realtime_client.session import AuthMethod, RealtimeSession, ResponseStream
from vllm_realtime_client.session import connect as async_connect
from vllm_realtime_protocol.events import (
    InputAckEvent,
    Limits,
    ResponseDoneEvent,
    ResponseTextDeltaEvent,
    ServerEvent,
    SessionClosedEvent,
    SessionConfig,
)

__all__ = ["SyncResponseStream", "SyncSession", "connect"]

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="vllm-realtime-client", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            if not future.done():  # KeyboardInterrupt (or similar) while waiting
                future.cancel()
                with contextlib.suppress(BaseException):
                    future.result(timeout=5)
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class SyncResponseStream:
    """Blocking twin of :class:`~vllm_realtime_client.session.ResponseStream`."""

    def __init__(self, runner: _LoopThread, stream: ResponseStream) -> None:
        self._runner = runner
        self._stream = stream

    @property
    def ack(self) -> InputAckEvent | None:
        """The ``input.ack``, once it arrived."""
        return self._stream.ack

    @property
    def done(self) -> ResponseDoneEvent | None:
        """The ``response.done``, once iteration has ended."""
        return self._stream.done

    @property
    def text(self) -> str:
        """The reply's text streamed so far."""
        return self._stream.text

    def __iter__(self) -> Iterator[ResponseTextDeltaEvent]:
        return self

    def __next__(self) -> ResponseTextDeltaEvent:
        try:
            return self._runner.run(self._anext())
        except StopAsyncIteration:
            raise StopIteration from None

    async def _anext(self) -> ResponseTextDeltaEvent:
        return await self._stream.__anext__()

    def result(self) -> ResponseDoneEvent:
        """Consume the rest of the stream and return its ``response.done``."""
        return self._runner.run(self._stream.result())


P = ParamSpec("P")


def _blocking(
    method: Callable[Concatenate[RealtimeSession, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[SyncSession, P], T]:
    def call(self: SyncSession, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._runner.run(method(self._session, *args, **kwargs))

    call.__name__ = method.__name__
    call.__doc__ = f"Blocking :meth:`RealtimeSession.{method.__name__}`.\n\n{method.__doc__ or ''}"
    return call


def _streaming(
    method: Callable[Concatenate[RealtimeSession, P], ResponseStream],
) -> Callable[Concatenate[SyncSession, P], SyncResponseStream]:
    def call(self: SyncSession, /, *args: P.args, **kwargs: P.kwargs) -> SyncResponseStream:
        return SyncResponseStream(self._runner, method(self._session, *args, **kwargs))

    call.__name__ = method.__name__
    call.__doc__ = f"Blocking :meth:`RealtimeSession.{method.__name__}`; iterate its deltas."
    return call


class SyncSession:
    """Blocking twin of :class:`~vllm_realtime_client.session.RealtimeSession`."""

    def __init__(self, runner: _LoopThread, session: RealtimeSession) -> None:
        self._runner = runner
        self._session = session

    @property
    def session(self) -> RealtimeSession:
        """The underlying asyncio session (use it only from the client's loop)."""
        return self._session

    @property
    def session_id(self) -> str:
        """The session's id."""
        return self._session.session_id

    @property
    def limits(self) -> Limits:
        """What the server allows."""
        return self._session.limits

    @property
    def config(self) -> SessionConfig | None:
        """The effective settings, once open."""
        return self._session.config

    @property
    def closed(self) -> SessionClosedEvent | None:
        """The ``session.closed`` event, once the session ended."""
        return self._session.closed

    # Each method is the async one run on the client's loop, with its exact signature
    # (ParamSpec): a type checker sees the same parameters as RealtimeSession's.
    open = _blocking(RealtimeSession.open)
    append_frame = _blocking(RealtimeSession.append_frame)
    ingest_frame = _blocking(RealtimeSession.ingest_frame)
    offer_frame = _blocking(RealtimeSession.offer_frame)
    ask = _blocking(RealtimeSession.ask)
    append_text = _blocking(RealtimeSession.append_text)
    cancel = _blocking(RealtimeSession.cancel)
    stream_frame = _streaming(RealtimeSession.stream_frame)
    stream_ask = _streaming(RealtimeSession.stream_ask)
    stream_text = _streaming(RealtimeSession.stream_text)

    def close(self, *, timeout: float | None = None) -> SessionClosedEvent | None:
        """End the session and stop the client's thread."""
        try:
            return self._runner.run(self._session.close(timeout=timeout))
        finally:
            self._runner.stop()

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


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
) -> SyncSession:
    """Connect and return a :class:`SyncSession` (a context manager); arguments as in
    :func:`vllm_realtime_client.connect`.  ``on_event`` runs on the client's thread."""
    runner = _LoopThread()

    async def _open() -> RealtimeSession:
        return await async_connect(
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
        )

    try:
        session = runner.run(_open())
    except BaseException:
        runner.stop()
        raise
    return SyncSession(runner, session)
