"""Graceful drain on SIGTERM and SIGINT, and the uvicorn server that runs it.

Theory of operation: a session is a long-lived engine request, so a server that stops must end
every session in the documented way (`response.done` for a reply in flight, then
`session.closed`) and then stop the engine, or its EngineCore and worker outlive it. uvicorn's
own handling does neither: it closes WebSockets with 1012 at once and re-raises the signal after
its shutdown, so SIGTERM killed the process (status -15) before the engine was stopped.

`DrainingServer` takes the signals over. The first SIGTERM or SIGINT starts `drain`:

1. admission stops (`Lifecycle.draining`: `session.open` and the HTTP adapter's open get
   `capacity_exceeded`, `/health` answers 503 `draining`, a new connection is told at once);
2. every connection gets `server.draining` with the seconds left (`--drain-timeout`) and is
   closed with reason `server_shutdown` as soon as it has no reply in flight: idle sessions at
   once, busy ones right after their `response.done`;
3. at the deadline, replies still running are cancelled (their `response.done` says
   `cancelled`, reason `server_shutdown`) and the rest is closed;
4. uvicorn then stops, and `run_server` shuts the engine down; the process exits 0.

A second signal skips the wait (step 3 at once). Engine processes ignore SIGINT and follow the
server's death on their own (`retention/vllm_adapter/lifecycle.py`).

A dead engine is drained the same way, with no time left (`drain_dead_engine`):
`Lifecycle.lose_engine` stops admission (new sessions get `engine_error`; on replicas sharing a
store new handshakes get 503, so the router tries another) and sets the deadline to now, and
each connection's `begin_drain` sees the lost engine: a stored session whose record is at its
last fold is handed over as a drain hands it over (`server.draining` with `handover`,
`session.closed` `server_shutdown`, its record kept), at once, since no reply can finish; any
other session ends with `engine_error`. The server then exits (realtime/server.py) unless it is
kept up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, MutableMapping
from typing import Any, Protocol

import uvicorn
from uvicorn.server import Server

from vllm_realtime_protocol import CapacityExceeded, EngineError

log = logging.getLogger("vllm_realtime")


class Lifecycle:
    """Whether the server still admits sessions, and the drain's deadline once it does not."""

    def __init__(self, drain_timeout_s: float) -> None:
        self.drain_timeout_s = drain_timeout_s
        self.draining = False
        self.deadline: float | None = None
        self.forced = asyncio.Event()
        # Why the engine died, once it did: the drain then has no time left (no reply can
        # finish) and sessions are refused with engine_error, not capacity_exceeded.
        self.engine_failure: str | None = None

    def start_drain(self) -> None:
        if not self.draining:
            self.draining = True
            self.deadline = time.monotonic() + self.drain_timeout_s

    def lose_engine(self, why: str) -> None:
        """The engine died: drain now (also when a drain was already under way)."""
        self.engine_failure = why
        self.start_drain()
        self.deadline = time.monotonic()

    def seconds_left(self) -> float:
        if self.deadline is None:
            return self.drain_timeout_s
        return max(0.0, self.deadline - time.monotonic())

    def check_admitting(self, event_id: str | None = None) -> None:
        """Raise capacity_exceeded while draining: retry elsewhere, or here once restarted;
        engine_error once the engine died."""
        if self.engine_failure is not None:
            raise EngineError(f"the engine is down: {self.engine_failure}", event_id=event_id)
        if self.draining:
            raise CapacityExceeded(
                "the server is shutting down; open the session again (another replica, or this "
                "server once it is back)",
                event_id=event_id,
            )


class Drainable(Protocol):
    """What `drain` needs of a WebSocket connection (realtime.server.Connection)."""

    @property
    def closed(self) -> bool: ...

    async def begin_drain(self, seconds_left: float) -> None:
        """Say `server.draining`; close at once if idle. Once the engine died
        (`Lifecycle.engine_failure`): hand a stored session over at once, or end it with
        engine_error."""

    async def close_for_shutdown(self) -> None: ...


async def drain(
    lifecycle: Lifecycle,
    connections: Collection[Drainable],
    http_sessions: MutableMapping[str, Any],
    close_http: Callable[[Any], Awaitable[None]],
) -> None:
    """Steps 1-3 of the module docstring; returns once no session is left."""
    lifecycle.start_drain()
    conns = list(connections)
    log.info(
        "draining: %d connections, %d HTTP sessions, %.1f s left",
        len(conns),
        len(http_sessions),
        lifecycle.seconds_left(),
    )
    left = lifecycle.seconds_left()
    # Concurrently: one client whose socket does not take the event must not hold up the rest.
    await asyncio.gather(*(c.begin_drain(left) for c in conns), return_exceptions=True)

    async def close_idle_http() -> None:
        for sid, record in list(http_sessions.items()):
            if not record.lock.locked():
                http_sessions.pop(sid, None)
                await close_http(record)

    while True:
        await close_idle_http()
        busy = [c for c in connections if not c.closed]
        if not busy and not http_sessions:
            break
        if lifecycle.forced.is_set() or lifecycle.seconds_left() <= 0:
            log.warning(
                "drain: %d connections and %d HTTP sessions still busy; cancelling",
                len(busy),
                len(http_sessions),
            )
            await asyncio.gather(*(c.close_for_shutdown() for c in busy), return_exceptions=True)
            for sid, record in list(http_sessions.items()):
                http_sessions.pop(sid, None)
                await close_http(record)
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(lifecycle.forced.wait(), timeout=0.05)
    log.info("drain finished")


async def drain_dead_engine(
    lifecycle: Lifecycle,
    connections: Collection[Drainable],
    http_sessions: MutableMapping[str, Any],
    close_http: Callable[[Any], Awaitable[None]],
    why: str,
) -> None:
    """The engine died: `drain` with no time left (the module docstring's last paragraph)."""
    lifecycle.lose_engine(why)
    await drain(lifecycle, connections, http_sessions, close_http)


class DrainingServer(Server):  # type: ignore[misc]  # reason: mypy skips uvicorn here (Any)
    """uvicorn.Server whose SIGTERM/SIGINT drain the app first and which exits without
    re-raising the signal (uvicorn re-raises it after shutdown: SIGTERM then killed the
    process with status -15, before anything stopped the engine)."""

    def __init__(self, config: uvicorn.Config, start_drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._start_drain = start_drain
        self._drain_task: asyncio.Task[None] | None = None
        self._force: Callable[[], None] = lambda: None

    def on_force(self, force: Callable[[], None]) -> None:
        """What a second signal does (the app's `Lifecycle.forced.set`)."""
        self._force = force

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()

        def handler(sig: int, frame: object) -> None:
            # A signal handler runs between two bytecodes of the main thread, possibly inside
            # the event loop's own code: hand the work to the loop.
            loop.call_soon_threadsafe(self._on_signal, sig)

        originals = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, original in originals.items():
                signal.signal(sig, original)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if not self.started:
            log.info("%s while starting: stopping", name)
            self.should_exit = True
            return
        if self._drain_task is None:
            log.info("%s: draining (a second signal closes sessions at once)", name)
            self._drain_task = asyncio.ensure_future(self._drain_then_exit())
        else:
            log.warning("%s again: closing every session now", name)
            self._force()

    async def _drain_then_exit(self) -> None:
        try:
            await self._start_drain()
        except Exception:
            log.exception("drain failed")
        finally:
            self.should_exit = True
