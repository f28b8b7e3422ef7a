"""A WebSocket server on loopback that plays scripted event sequences to a real client.

Unlike ``fake_server.py`` (the server's own machine, a scripted "engine"), nothing here decides
what to send: each accepted connection runs the next script given to :func:`scripted_server`,
a coroutine that reads what the client sends (:meth:`Peer.expect`) and sends exactly the server
events it names, in its order, including sequences a real server sends only on a fault (a
``session.closed`` while a reply runs, a dropped socket, a resume that lost its reply). So a
test can take a client through every turn of the protocol's tables on demand, with no engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from vllm_realtime_protocol import (
    InputAckEvent,
    Limits,
    RealtimeError,
    ResponseCreatedEvent,
    ResponseDoneEvent,
    ResponseTextDeltaEvent,
    SessionClosedEvent,
    SessionConfig,
    SessionCreatedEvent,
    SessionOpenedEvent,
    SessionOpenEvent,
    SessionResumedEvent,
    encode_server_event,
    error_event,
    parse_client_event,
)
from vllm_realtime_protocol.events import ClientEvent, ServerEvent

__all__ = ["LIMITS", "SESSION_ID", "Peer", "Script", "ScriptedServer", "scripted_server"]

SESSION_ID = "sess_scripted"
LIMITS = Limits(server_version="scripted", model="scripted-model", max_frame_bytes=1 << 20)
_E = TypeVar("_E")


class Peer:
    """One accepted connection, as its script sees it."""

    def __init__(self, ws: ServerConnection, timeout: float) -> None:
        self.ws = ws
        self.timeout = timeout
        self.received: list[ClientEvent | bytes] = []

    async def send(self, *events: ServerEvent) -> None:
        for event in events:
            await self.ws.send(encode_server_event(event))

    async def recv(self) -> ClientEvent | bytes:
        """The client's next message: a parsed client event, or a binary payload."""
        raw = await asyncio.wait_for(self.ws.recv(), self.timeout)
        message: ClientEvent | bytes = raw if isinstance(raw, bytes) else parse_client_event(raw)
        self.received.append(message)
        return message

    async def expect(self, kind: type[_E]) -> _E:
        message = await self.recv()
        assert isinstance(message, kind), f"expected {kind.__name__}, the client sent {message!r}"
        return message

    async def binary(self) -> bytes:
        return await self.expect(bytes)

    async def drop(self) -> None:
        """End the connection as a crashed server does: no close frame."""
        self.ws.transport.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.wait_closed(), self.timeout)

    async def end(self) -> None:
        """Close the connection cleanly (after a ``session.closed``)."""
        await self.ws.close()

    # -- the server events scripts send most, filled in as a server would

    async def greet(self, session_id: str = SESSION_ID) -> None:
        await self.send(SessionCreatedEvent(session_id=session_id, limits=LIMITS))

    async def open(self, resume_token: str | None = None) -> SessionOpenEvent:
        """Read a session.open and answer it with session.opened."""
        event = await self.expect(SessionOpenEvent)
        await self.send(opened(event, resume_token))
        return event

    async def reply(self, frame_index: int, *parts: str, status: str = "completed") -> None:
        """A whole reply: response.created, a delta per part, response.done."""
        await self.send(ResponseCreatedEvent(frame_index=frame_index))
        for part in parts:
            await self.send(ResponseTextDeltaEvent(frame_index=frame_index, delta=part))
        await self.send(done(frame_index, "".join(parts), status))

    async def closed(self, reason: str, frames_total: int = 0) -> None:
        await self.send(closed(reason, frames_total))


Script = Callable[[Peer], Awaitable[None]]


def opened(event: SessionOpenEvent, resume_token: str | None = None) -> SessionOpenedEvent:
    config = SessionConfig(**{name: getattr(event, name) for name in SessionConfig.model_fields})
    return SessionOpenedEvent(
        session_id=SESSION_ID, config=config, limits=LIMITS, resume_token=resume_token
    )


def ack(frame_index: int, frame_id: str | None = None) -> InputAckEvent:
    return InputAckEvent(frame_index=frame_index, frame_id=frame_id, bytes=1)


def done(frame_index: int, text: str = "", status: str = "completed") -> ResponseDoneEvent:
    return ResponseDoneEvent.model_validate(
        {"frame_index": frame_index, "text": text, "status": status}
    )


def closed(reason: str, frames_total: int = 0) -> SessionClosedEvent:
    return SessionClosedEvent.model_validate(
        {"session_id": SESSION_ID, "reason": reason, "frames_total": frames_total}
    )


def refusal(exc: RealtimeError) -> ServerEvent:
    return error_event(exc)


def resumed(
    config: SessionConfig,
    *,
    next_frame_index: int,
    in_flight_frame_index: int | None = None,
    resume_token: str = "tok-2",
    **fields: Any,
) -> SessionResumedEvent:
    return SessionResumedEvent(
        session_id=SESSION_ID,
        config=config,
        limits=LIMITS,
        next_frame_index=next_frame_index,
        in_flight_frame_index=in_flight_frame_index,
        resume_token=resume_token,
        **fields,
    )


@dataclass
class ScriptedServer:
    url: str = ""
    peers: list[Peer] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)
    """What the scripts raised (a script's assertion is the test's)."""


@contextlib.asynccontextmanager
async def scripted_server(*scripts: Script, timeout: float = 5.0) -> AsyncIterator[ScriptedServer]:
    """Serve on 127.0.0.1: the n-th connection runs the n-th script. On exit, waits for the
    scripts still running (at most ``timeout``, then cancels them), and raises the first thing
    a script raised."""
    state = ScriptedServer()
    queue = list(scripts)
    running: set[asyncio.Task[None]] = set()

    async def handler(ws: ServerConnection) -> None:
        if not queue:
            state.failures.append(AssertionError("a connection no script was written for"))
            return
        peer = Peer(ws, timeout)
        state.peers.append(peer)
        task = asyncio.current_task()
        assert task is not None
        running.add(task)
        try:
            await queue.pop(0)(peer)
        except ConnectionClosed:
            pass  # the client went away: what the script waited for is not the server's to do
        except BaseException as exc:
            state.failures.append(exc)
        finally:
            running.discard(task)

    async with serve(
        handler, "127.0.0.1", 0, subprotocols=[Subprotocol("vllm-realtime")]
    ) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        state.url = f"ws://127.0.0.1:{port}/v1/realtime"
        yield state
        for _ in range(int(timeout * 100)):
            if not running:
                break
            await asyncio.sleep(0.01)
        for task in list(running):  # a script still waiting would hold the server open
            state.failures.append(AssertionError(f"a script was still running: {task!r}"))
            task.cancel()
    if state.failures:
        raise state.failures[0]
    assert not queue, f"{len(queue)} scripted connection(s) never came"
