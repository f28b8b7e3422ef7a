"""One WebSocket connection: a thin transport between a socket, its `SessionProtocol` and the
session hub (realtime/hub.py), which owns the session registry and runs turns.

Fail-closed: a disconnect aborts the session (its KV blocks are freed) unless it is resumable
and parks; an engine failure closes it with an `error`; shutdown closes it cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from starlette.websockets import WebSocketState

from realtime.config import ServerConfig
from realtime.drain import Lifecycle
from realtime.hub import SessionHub, SessionRecord
from realtime.resumption import ResumeTokens
from realtime.session import Rebuilt, Session
from vllm_realtime_protocol import (
    AwaitBinary,
    CancelResponse,
    CloseSession,
    EngineError,
    ErrorEvent,
    FrameAppendEvent,
    IdleTimeout,
    InternalError,
    OpenSession,
    RateLimited,
    RealtimeError,
    ResponseCreatedEvent,
    ResumeSession,
    ServerCloseReason,
    ServerDrainingEvent,
    ServerEvent,
    SessionConfig,
    SessionNotFound,
    SessionOpenEvent,
    SessionProtocol,
    SubmitFrame,
    UpdateSession,
    encode_server_event,
    error_event,
    parse_client_event,
)

log = logging.getLogger("vllm_realtime")


async def _close_quietly(ws: WebSocket, code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.close(code=code)


class _FrameBucket:
    """Token bucket of one connection's frame.append events (`rate` per second, `burst` deep).

    Added for the reliability issue: nothing limited how fast a client could push frames (each
    one a base64 decode, an image decode and an error or a turn); over the rate a frame gets
    `rate_limited` and is dropped. A rate of 0 turns the limit off."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self.tokens = float(self.burst)
        self.stamp = time.monotonic()

    def take(self) -> bool:
        if self.rate <= 0:
            return True
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class _Socket:
    """One WebSocket as its connection writes to it: one send at a time, and the rate bucket of
    the frame.append events read from it (a new socket starts a new bucket)."""

    __slots__ = ("frames", "lock", "ws")

    def __init__(self, ws: WebSocket, config: ServerConfig) -> None:
        self.ws = ws
        self.lock = asyncio.Lock()
        self.frames = _FrameBucket(config.max_frames_per_s, config.frame_burst)

    @property
    def connected(self) -> bool:
        return self.ws.client_state == WebSocketState.CONNECTED

    async def send_text(self, text: str) -> None:
        if not self.connected:
            return
        async with self.lock:
            with contextlib.suppress(Exception):
                await self.ws.send_text(text)


@dataclass(frozen=True)
class Serving:
    """What every connection of one server shares: the drain, the resumable sessions' tokens
    (None: no resumption) and the live connections (the drain walks them)."""

    lifecycle: Lifecycle
    resume_tokens: ResumeTokens[Connection] | None = None
    connections: set[Connection] | None = None


# Old sockets closed in the background after a resume took their session (a half-open
# socket's close handshake waits for its timeout): held here until done.
_closing: set[asyncio.Task[None]] = set()


class Connection:
    """One WebSocket transport: reads events from its socket into its `Session` and writes the
    session's events back; the session (realtime/session.py) holds all of its state.

    A resumable session outlives its socket: on a drop the session is *parked* (no socket,
    the turn runs on, an expiry timer runs), and `session.resume` on another socket hands that
    socket to this Connection (`take_over`), which then serves it (`serve_resumed`)."""

    # The socket, the session it carries, the hub, the server's shared objects, and the
    # Connection this socket was handed to by a session.resume: nothing else (test_layering).
    __slots__ = ("handed_to", "hub", "serving", "session", "socket")

    def __init__(
        self,
        ws: WebSocket,
        hub: SessionHub,
        owner: str | None,
        lifecycle: Lifecycle | None = None,
        resumable: ResumeTokens[Connection] | None = None,
        connections: set[Connection] | None = None,
        bound_config: SessionConfig | None = None,
        *,
        session: Session | None = None,
    ) -> None:
        self.socket = _Socket(ws, hub.config)
        self.hub = hub
        self.serving = Serving(
            lifecycle or Lifecycle(hub.config.drain_timeout_s), resumable, connections
        )
        # The session this socket serves: its machine, its engine session, its store writer.
        self.session = (
            session if session is not None else Session(hub, owner, bound_config=bound_config)
        )
        self.session.on_lost = self._let_go
        # session.resume on this socket succeeded: the socket now serves that Connection.
        self.handed_to: Connection | None = None

    @property
    def ws(self) -> WebSocket:
        return self.socket.ws

    @property
    def proto(self) -> SessionProtocol:
        return self.session.protocol

    @property
    def record(self) -> SessionRecord | None:
        return self.session.record

    @property
    def owner(self) -> str | None:
        return self.session.owner

    @property
    def closed(self) -> bool:
        return self.session.closed

    @property
    def parked(self) -> bool:
        return self.session.parked

    @property
    def lifecycle(self) -> Lifecycle:
        return self.serving.lifecycle

    async def send(self, event: ServerEvent) -> None:
        if isinstance(event, ErrorEvent):
            self.hub.metrics.errors.labels(event.error.code).inc()
        await self.socket.send_text(encode_server_event(event))

    async def send_error(self, exc: RealtimeError) -> None:
        await self.send(error_event(exc))

    async def run(self) -> Connection | None:
        """Serve this socket; the Connection it was handed to by session.resume, if any (the
        caller then goes on with `serve_resumed` of that one, on the same socket)."""
        await self.send(self.proto.greeting())
        if self.lifecycle.draining and self.lifecycle.engine_failure is None:
            # Connected while the server drains: told at once, instead of a refused open. (The
            # engine is dead: the open gets engine_error, as its answer.)
            await self.begin_drain(self.lifecycle.seconds_left())
        return await self._serve(self.ws)

    async def serve_resumed(self) -> Connection | None:
        """Serve the socket `take_over` attached (session.resumed is already sent)."""
        return await self._serve(self.ws)

    async def _serve(self, ws: WebSocket) -> Connection | None:
        # One receive stays pending across turns. The old loop computed the idle timeout once
        # per receive, so a receive started while a turn ran waited with no timeout forever: a
        # client that sent one frame and went quiet held its session (and KV) for good. Now
        # the end of a turn wakes the loop and the idle clock restarts from there.
        receiving: asyncio.Future[Any] | None = None
        try:
            while not self.closed:
                if self.ws is not ws:
                    return None  # taken over by another socket (this one was half-open)
                if self.handed_to is not None:
                    return self.handed_to
                if receiving is None:
                    receiving = asyncio.ensure_future(ws.receive())
                turn = self.session.turn_running()
                waiting: set[asyncio.Future[Any]] = (
                    {receiving} if turn is None else {receiving, turn}
                )
                done, _ = await asyncio.wait(
                    waiting, timeout=self._timeout(turn), return_when=asyncio.FIRST_COMPLETED
                )
                if receiving not in done:
                    if turn is not None or self.ws is not ws:
                        continue  # the turn ended (wait again, now with the idle clock), or
                        # the session moved to another socket (the loop's head returns)
                    await self.send_error(IdleTimeout("no client event within the idle timeout"))
                    await self.finish(self.proto.server_close("idle_timeout"))
                    return None
                message, receiving = receiving.result(), None
                if self.ws is not ws:
                    return None
                self.session.touch()
                if message["type"] == "websocket.disconnect":
                    raise WebSocketDisconnect(message.get("code", 1000))
                await self.handle(dict(message))
        except WebSocketDisconnect:
            if self.ws is not ws:
                return None
            if self.session.can_park(self.lifecycle.draining):
                self.session.park(self._expired)
                return None
            await self.finish(self.proto.server_close("disconnect"), socket_gone=True)
        except Exception:
            # A server bug must still end in the documented way (internal_error, then
            # session.closed), with the engine request freed, not as a bare 1011 close.
            log.exception("connection failed")
            await self.send_error(InternalError("internal server error"))
            await self.finish(self.proto.server_close("error"))
        finally:
            if receiving is not None and not receiving.done():
                receiving.cancel()
            if self.ws is ws and not self.parked and self.handed_to is None:
                await self.finish(self.proto.server_close("disconnect"), socket_gone=True)
        return self.handed_to

    # -- resumption (realtime/resumption.py)

    async def _expired(self) -> None:
        await self.finish(self.proto.server_close("expired"), socket_gone=True)

    async def take_over(
        self, ws: WebSocket, token: str | None = None, *, reprefilled: int | None = None
    ) -> None:
        """session.resume from `ws` was accepted: the session continues on that socket.

        Whether it was parked or its old socket still looks open (half-open TCP: the server
        has not seen the drop yet), the old socket is let go and never serves it again.
        `token`: the new token the session store issued; `reprefilled`: set when this server
        rebuilt the session from the store (the tokens it re-prefilled)."""
        old = self.ws
        if not self.parked:
            self.proto.detach()
            if old.client_state == WebSocketState.CONNECTED:
                # The old socket's loop sees `self.ws is not ws` and returns; close it in the
                # background (a half-open socket's close handshake waits for its timeout).
                closing = asyncio.create_task(_close_quietly(old, 4000))
                _closing.add(closing)
                closing.add_done_callback(_closing.discard)
        self.session.unpark()
        self.socket = _Socket(ws, self.hub.config)
        self.session.draining = False
        self.session.touch()
        resume_tokens = self.serving.resume_tokens
        assert resume_tokens is not None
        rotated_here = token is None
        token = resume_tokens.issue(self.proto.session_id, self.owner, self, token)
        if rotated_here and self.hub.store is not None:
            await self.session.token_rotated(token)
        resumed = self.proto.resumed(token)
        if reprefilled is not None:
            resumed = resumed.model_copy(
                update={"rebuilt": True, "reprefilled_tokens": reprefilled}
            )
        self.hub.metrics.sessions_resumed.inc()
        log.info(
            "session resumed id=%s next_frame=%d missed_response=%s rebuilt=%s",
            self.proto.session_id[:12],
            resumed.next_frame_index,
            resumed.missed_response is not None,
            reprefilled is not None,
        )
        await self.send(resumed)

    def _timeout(self, turn: asyncio.Task[None] | None) -> float | None:
        # A turn in flight is the server's business, not the client's idleness.
        if turn is not None:
            return None
        idle_since = self.session.last_activity
        return max(0.0, idle_since + self.hub.config.idle_timeout_s - time.monotonic())

    async def handle(self, message: dict[str, Any]) -> None:
        event_id: str | None = None
        try:
            if message.get("bytes") is not None:
                action: Any = self.proto.receive_binary(message["bytes"])
            else:
                text = message.get("text")
                event = parse_client_event(
                    text if text is not None else b"", max_bytes=self.proto.limits.max_event_bytes
                )
                event_id = event.event_id
                bound = self.session.bound_config
                if isinstance(event, SessionOpenEvent) and bound is not None:
                    event = SessionOpenEvent(**dict(bound), event_id=event_id)
                frames = self.socket.frames
                if isinstance(event, FrameAppendEvent) and not frames.take():
                    raise RateLimited(
                        f"more than {frames.rate:g} frames per second (burst "
                        f"{frames.burst}); this frame.append was dropped",
                        event_id=event.event_id,
                    )
                action = self.proto.receive_client_event(event)
        except RealtimeError as exc:
            await self.send_error(exc)
            if not exc.session_survives:
                await self.finish(self.proto.server_close("error"))
            return
        await self.carry_out(action, event_id)

    async def carry_out(self, action: Any, event_id: str | None = None) -> None:
        if isinstance(action, OpenSession):
            try:
                self.lifecycle.check_admitting(event_id)
                self.hub.ensure_text_or_video(action.config)
                record = await self.hub.open_session(
                    self.proto, action.config, self.owner, "websocket"
                )
                if self.closed:
                    # Closed (a drain) while admission ran: nobody will ever close it.
                    await self.hub.close_session(record)
                    return
                self.session.record = record
                action = OpenSession(
                    action.config,
                    action.event.model_copy(update={"reservation": self.hub.reservation(record)}),
                )
                resume_tokens = self.serving.resume_tokens
                if action.config.resumable is not None and resume_tokens is not None:
                    token = resume_tokens.issue(self.proto.session_id, self.owner, self)
                    action = OpenSession(
                        action.config, action.event.model_copy(update={"resume_token": token})
                    )
                    if self.hub.stored(action.config):
                        await self.session.store_open(token)
            except RealtimeError as exc:
                # Admission errors answer the session.open: echo its event_id (they did not).
                exc.event_id = exc.event_id or event_id
                self.proto.open_refused()
                await self.send_error(exc)
                if not exc.session_survives:
                    # A fatal refusal (engine_error: the engine is down) ends the connection
                    # as documented for fatal errors; it used to leave it open and CONNECTED.
                    fatal: ServerCloseReason = (
                        "engine_error" if isinstance(exc, EngineError) else "error"
                    )
                    await self.finish(self.proto.server_close(fatal))
                return
            await self.send(action.event)
        elif isinstance(action, AwaitBinary):
            return
        elif isinstance(action, SubmitFrame):
            await self.send(action.ack)
            self.session.start_turn(self._run_turn(action))
        elif isinstance(action, CancelResponse):
            self.session.cancelled.set()
        elif isinstance(action, CloseSession):
            await self.finish(action)
        elif isinstance(action, ResumeSession):
            await self._resume(action)
        elif isinstance(action, UpdateSession):
            await self._update(action, event_id)

    async def _update(self, action: UpdateSession, event_id: str | None) -> None:
        assert self.record is not None
        try:
            self.hub.update_session(self.record, action.config)
        except RealtimeError as exc:
            exc.event_id = exc.event_id or event_id
            self.proto.update_refused(action.previous)
            await self.send_error(exc)
            return
        await self.send(action.event)

    async def _resume(self, action: ResumeSession) -> None:
        """session.resume on this fresh connection: hand the socket to the session's holder."""
        token: str | None = None
        reprefilled: int | None = None
        resume_tokens = self.serving.resume_tokens
        try:
            self.lifecycle.check_admitting(action.event_id)
            if resume_tokens is None:
                raise SessionNotFound("this server keeps no resumable sessions")
            claimed = await Session.claim(
                self.hub, action, self.owner, lambda: self._local_session(action.session_id)
            )
            if claimed is not None:
                holder, token, reprefilled = self._holder_of(claimed)
            else:
                holder = resume_tokens.claim(
                    action.session_id, action.resume_token, self.owner, action.event_id
                )
                if holder.session.fence is not None:
                    # A stored session is resumed through the store only (it rotates the
                    # token for every replica; this replica's copy may be stale).
                    raise SessionNotFound(
                        "no resumable session with this id and token", event_id=action.event_id
                    )
            if holder.closed:  # pragma: no cover (closed sessions are forgotten at once)
                raise SessionNotFound("no such session", event_id=action.event_id)
        except RealtimeError as exc:
            await self.send_error(exc)
            if not exc.session_survives:
                await self.finish(self.proto.server_close("error"))
            return
        # This connection never opened a session of its own: it ends without a word, and its
        # socket goes on serving the resumed session.
        self.session.closed = True
        if self.serving.connections is not None:
            self.serving.connections.discard(self)
        self.handed_to = holder
        if holder.serving.connections is not None:
            holder.serving.connections.add(holder)
        await holder.take_over(self.ws, token, reprefilled=reprefilled)
        holder.session.start_keeper()

    def _local_session(self, session_id: str) -> Session | None:
        assert self.serving.resume_tokens is not None
        local = self.serving.resume_tokens.holder(session_id)
        return None if local is None else local.session

    def _holder_of(self, claimed: Rebuilt) -> tuple[Connection, str, int | None]:
        """The Connection that serves a session claimed from the store: this replica's own
        holder, or a new one (parked: `take_over` attaches it) for a rebuilt session."""
        if claimed.reprefilled is None:
            assert self.serving.resume_tokens is not None
            local = self.serving.resume_tokens.holder(claimed.session.session_id)
            assert local is not None and local.session is claimed.session
            return local, claimed.token, None
        serving = self.serving
        holder = Connection(
            self.ws,
            self.hub,
            self.owner,
            serving.lifecycle,
            serving.resume_tokens,
            serving.connections,
            session=claimed.session,
        )
        claimed.session.parked_elsewhere()  # take_over attaches it, as a parked one
        return holder, claimed.token, claimed.reprefilled

    async def _let_go(self) -> None:
        """Another replica claimed this session (the store writer let it go): end it here."""
        socket_gone = self.parked or not self.socket.connected
        if not socket_gone:
            await self.send_error(SessionNotFound("this session was resumed on another connection"))
        await self.finish(self.proto.server_close("error"), socket_gone=socket_gone)

    async def _run_turn(self, action: SubmitFrame) -> None:
        frame = action.frame
        session = self.session
        if frame.reply:  # an ingested chunk (reply: false) has no reply to announce
            await self.send(
                ResponseCreatedEvent(frame_index=frame.frame_index, frame_id=frame.frame_id)
            )
        try:
            ended = await session.run_turn(frame, send=self.send)
            if ended is None:
                session.turn = None  # _let_go's finish must not cancel the task it runs in
                await session.let_go()
                return
            if ended.engine_lost:
                if await self.hand_over_lost_engine():
                    return
                await self.send(ended.done)  # not stored: its session ends with engine_error
                if ended.error is not None:
                    await self.send_error(ended.error)
            if ended.close_reason is not None:
                await self.finish(self.proto.server_close(ended.close_reason))
        except Exception:
            # Not a protocol error: a server bug. Without this the accepted chunk never got its
            # response.done and the task's exception went unretrieved.
            log.exception("turn failed")
            await self.send_error(InternalError("internal server error"))
            await self.finish(self.proto.server_close("error"))
        finally:
            session.touch()
            if session.draining and not self.closed:
                await self.finish(self.proto.server_close("server_shutdown"))

    # -- graceful drain (realtime/drain.py)

    async def begin_drain(self, seconds_left: float) -> None:
        """The server is shutting down: say so, and close now unless a reply is in flight
        (then `_run_turn` closes right after its response.done). After the engine died
        (realtime/drain.py, `drain_dead_engine`): hand over at once, or end with engine_error."""
        if not self.closed and (why := self.lifecycle.engine_failure) is not None:
            if not await self.hand_over_lost_engine():
                await self.send_error(EngineError(f"the engine is down: {why}"))
                await self.finish(self.proto.server_close("engine_error"))
            return
        if self.closed or self.session.draining:
            return
        self.session.draining = True
        # A stored session is handed over: its record stays in the store (its last fold is
        # written before the close), and the client resumes it on another replica.
        handover = self.session.fence is not None
        await self.send(ServerDrainingEvent(seconds_left=round(seconds_left, 3), handover=handover))
        if self.session.turn_running() is None:
            await self.finish(self.proto.server_close("server_shutdown"))

    async def hand_over_lost_engine(self) -> bool:
        """The engine died. A session whose record in the store is at its last fold is handed
        over as a drain hands it over (`server.draining` with `handover`, `session.closed`
        `server_shutdown`, the record kept), so the client resumes it on another replica; the
        chunk in flight gets no response.done here: the resumed session's `next_frame_index`
        is that chunk's, and the client sends it again. False: not stored, or the store missed
        a fold (the caller ends it with engine_error)."""
        session = self.session
        if self.closed:
            return session.lost_engine
        if session.fence is None or not session.store_ok:
            return False
        told = session.draining  # a drain under way already said server.draining (handover)
        session.draining = session.lost_engine = True
        log.warning("engine died: session handed over id=%s", self.proto.session_id[:12])
        if not told:
            await self.send(ServerDrainingEvent(seconds_left=0.0, handover=True))
        await self.finish(self.proto.server_close("server_shutdown"), socket_gone=self.parked)
        return True

    async def close_for_shutdown(self) -> None:
        """The drain's deadline passed: cancel the reply in flight and close."""
        await self.finish(self.proto.server_close("server_shutdown"))

    async def finish(self, close: CloseSession | None, *, socket_gone: bool = False) -> None:
        """Close the session once: stop the turn, free the engine request, say goodbye."""
        session = self.session
        if close is None and self.closed:
            return
        session.closed = True
        session.unpark()
        # Closed or expired here: nothing of it stays in the store, unless it is handed over.
        handover = session.draining and close is not None and close.reason == "server_shutdown"
        await session.stop_storing(keep_record=handover)
        if self.serving.resume_tokens is not None:
            self.serving.resume_tokens.forget(self.proto.session_id)
        if self.serving.connections is not None:
            self.serving.connections.discard(self)
        await session.stop_turn()
        if not session.lost_engine and (done := session.end_in_flight(close)) is not None:
            # An accepted chunk always gets its response.done, even when the session ends
            # (but for a dead engine's hand-over: the chunk is sent again after the resume).
            await self.send(done)
        if self.record is not None:
            await self.hub.close_session(self.record)
        if close is not None and not socket_gone:
            await self.send(close.event)
        if not socket_gone and self.socket.connected:
            with contextlib.suppress(Exception):
                await self.ws.close(code=1000)
