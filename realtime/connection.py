"""One WebSocket connection: a thin transport between a socket, its `SessionProtocol` and the
session hub (realtime/hub.py), which owns the session registry and runs turns.

Fail-closed: a disconnect aborts the session (its KV blocks are freed) unless it is resumable
and parks; an engine failure closes it with an `error`; shutdown closes it cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect
from starlette.websockets import WebSocketState

from realtime.drain import Lifecycle
from realtime.hub import SessionHub, SessionRecord
from realtime.resumption import ResumeTokens, new_token
from realtime.session_store import MediaKind, StoredSession, digest, held_media
from vllm_realtime_protocol import (
    AwaitBinary,
    CancelResponse,
    CapacityExceeded,
    CloseSession,
    EngineError,
    ErrorEvent,
    Frame,
    FrameAppendEvent,
    IdleTimeout,
    InternalError,
    OpenSession,
    RateLimited,
    RealtimeError,
    ResponseCreatedEvent,
    ResponseStatus,
    ResumeSession,
    ServerCloseReason,
    ServerDrainingEvent,
    ServerEvent,
    SessionConfig,
    SessionNotFound,
    SessionOpenEvent,
    SessionProtocol,
    State,
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


class Connection:
    """One WebSocket connection: its protocol state, its session, its turn task.

    A resumable session outlives its socket: on a drop the Connection is *parked* (no socket,
    the turn runs on, an expiry timer runs), and `session.resume` on another socket hands that
    socket to this Connection (`take_over`), which then serves it (`serve_resumed`)."""

    def __init__(
        self,
        ws: WebSocket,
        hub: SessionHub,
        owner: str | None,
        lifecycle: Lifecycle | None = None,
        resumable: ResumeTokens[Connection] | None = None,
        connections: set[Connection] | None = None,
        bound_config: SessionConfig | None = None,
    ) -> None:
        self.ws = ws
        # Connected with a client secret bound to a session config: session.open opens it.
        self.bound_config = bound_config
        self.lifecycle = lifecycle or Lifecycle(hub.config.drain_timeout_s)
        self.resume_tokens = resumable
        # The server's live connections (drain walks them); a parked one stays in until closed.
        self.connections = connections
        self.parked = False
        self.expiry: asyncio.Task[None] | None = None
        # session.resume on this socket succeeded: the socket now serves that Connection.
        self.handed_to: Connection | None = None
        self.closing_old: asyncio.Task[None] | None = None
        # server.draining was sent: close the session as soon as no reply is in flight.
        self.draining = False
        self.hub = hub
        self.owner = owner
        self.proto: SessionProtocol = hub.new_protocol()
        self.record: SessionRecord | None = None
        self.turn: asyncio.Task[None] | None = None
        self.cancelled = asyncio.Event()
        self.send_lock = asyncio.Lock()
        self.closed = False
        self.frames = _FrameBucket(hub.config.max_frames_per_s, hub.config.frame_burst)
        # Last client event or end of a turn: the idle clock runs from whichever came last.
        self.last_activity = time.monotonic()
        # Session store (issue #39): the fence this connection holds for its session (None:
        # not stored), the task that keeps the lease, and the writes of its folds in order.
        self.fence: int | None = None
        self.keeper: asyncio.Task[None] | None = None
        self.store_lock = asyncio.Lock()
        self.store_seq = 0
        # Video sessions: the frame kind each stored (retained, whole) chunk segment holds, the
        # snapshot's next segment index at the last fold, and the frames and deletions not yet
        # written (a failed write retries them with the next fold).
        self.media: dict[int, MediaKind] = {}
        self.media_next = 0
        self.frames_unwritten: dict[int, bytes] = {}
        self.frames_to_drop: set[int] = set()
        # Store outages (docs/reliability.md): whether the record in the store is at the last
        # fold (False: a write failed; the keeper rewrites `last_state` once Redis answers),
        # and what rewrites the whole record if Redis restarts without it: the current token's
        # digest, the Redis run id of the last write, every retained frame's bytes.
        self.store_ok = True
        self.last_state: StoredSession | None = None
        self.token_digest: str | None = None
        self.store_run: str | None = None
        self.frames_held: dict[int, bytes] = {}
        # The engine died under this stored session: it is handed over, and the chunk in
        # flight gets no response.done here (the client sends it again after the resume).
        self.lost_engine = False

    async def send(self, event: ServerEvent) -> None:
        if isinstance(event, ErrorEvent):
            self.hub.metrics.errors.labels(event.error.code).inc()
        if self.ws.client_state != WebSocketState.CONNECTED:
            return
        async with self.send_lock:
            with contextlib.suppress(Exception):
                await self.ws.send_text(encode_server_event(event))

    async def send_error(self, exc: RealtimeError) -> None:
        await self.send(error_event(exc))

    async def run(self) -> Connection | None:
        """Serve this socket; the Connection it was handed to by session.resume, if any (the
        caller then goes on with `serve_resumed` of that one, on the same socket)."""
        await self.send(self.proto.greeting())
        if self.lifecycle.draining:
            # Connected while the server drains: told at once, instead of a refused open.
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
                turn = self.turn if self.turn is not None and not self.turn.done() else None
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
                self.last_activity = time.monotonic()
                if message["type"] == "websocket.disconnect":
                    raise WebSocketDisconnect(message.get("code", 1000))
                await self.handle(dict(message))
        except WebSocketDisconnect:
            if self.ws is not ws:
                return None
            if self._can_park():
                self._park()
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

    def _can_park(self) -> bool:
        config = self.proto.config
        return (
            config is not None
            and config.resumable is not None
            and self.record is not None
            and not self.draining
            and not self.lifecycle.draining
            and self.proto.state in (State.IDLE, State.AWAITING_BINARY, State.AWAITING_RESPONSE)
        )

    def _park(self) -> None:
        """The socket dropped: keep the session (engine request, KV, reservation) for its grace
        period; a reply in flight runs on and its response.done is kept (vllm_realtime_protocol.state)."""
        config = self.proto.config
        assert config is not None and config.resumable is not None
        self.proto.detach()
        self.parked = True
        self.hub.metrics.sessions_parked.inc()
        grace = config.resumable.grace_s
        self.expiry = asyncio.create_task(self._expire_after(grace))
        log.info("session parked id=%s grace=%.1fs", self.proto.session_id[:12], grace)

    async def _expire_after(self, grace: float) -> None:
        await asyncio.sleep(grace)
        if not self.parked or self.closed:
            return
        log.info("session expired id=%s", self.proto.session_id[:12])
        self.hub.metrics.sessions_expired.inc()
        self.expiry = None  # finish must not cancel the task it runs in
        await self.finish(self.proto.server_close("expired"), socket_gone=True)

    def _unpark(self) -> None:
        if self.parked:
            self.parked = False
            self.hub.metrics.sessions_parked.dec()
        expiry, self.expiry = self.expiry, None
        if expiry is not None and expiry is not asyncio.current_task():
            expiry.cancel()

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
                self.closing_old = asyncio.create_task(_close_quietly(old, 4000))
        self._unpark()
        self.ws = ws
        self.draining = False
        self.frames = _FrameBucket(self.hub.config.max_frames_per_s, self.hub.config.frame_burst)
        self.last_activity = time.monotonic()
        assert self.resume_tokens is not None
        token = self.resume_tokens.issue(self.proto.session_id, self.owner, self, token)
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
        return max(0.0, self.last_activity + self.hub.config.idle_timeout_s - time.monotonic())

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
                if isinstance(event, SessionOpenEvent) and self.bound_config is not None:
                    event = SessionOpenEvent(**dict(self.bound_config), event_id=event_id)
                if isinstance(event, FrameAppendEvent) and not self.frames.take():
                    raise RateLimited(
                        f"more than {self.frames.rate:g} frames per second (burst "
                        f"{self.frames.burst}); this frame.append was dropped",
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
                self.record = record
                action = OpenSession(
                    action.config,
                    action.event.model_copy(update={"reservation": self.hub.reservation(record)}),
                )
                if action.config.resumable is not None and self.resume_tokens is not None:
                    token = self.resume_tokens.issue(self.proto.session_id, self.owner, self)
                    action = OpenSession(
                        action.config, action.event.model_copy(update={"resume_token": token})
                    )
                    if self.hub.stored(action.config):
                        await self._store_open(token)
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
            self.cancelled.clear()
            self.turn = asyncio.create_task(self._run_turn(action))
        elif isinstance(action, CancelResponse):
            self.cancelled.set()
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
        try:
            self.lifecycle.check_admitting(action.event_id)
            if self.resume_tokens is None:
                raise SessionNotFound("this server keeps no resumable sessions")
            claimed = await self._claim_from_store(action)
            if claimed is not None:
                holder, token, reprefilled = claimed
            else:
                holder = self.resume_tokens.claim(
                    action.session_id, action.resume_token, self.owner, action.event_id
                )
                if holder.fence is not None:
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
        self.closed = True
        if self.connections is not None:
            self.connections.discard(self)
        self.handed_to = holder
        if holder.connections is not None:
            holder.connections.add(holder)
        await holder.take_over(self.ws, token, reprefilled=reprefilled)
        if holder.fence is not None and holder.keeper is None:
            holder.keeper = asyncio.create_task(holder._keep_lease())

    # -- the session store (realtime/session_store.py)

    def _grace(self) -> float:
        config = self.proto.config
        assert config is not None and config.resumable is not None
        return config.resumable.grace_s

    async def _store_open(self, token: str) -> None:
        store = self.hub.store
        assert store is not None
        state = self._stored_state()
        try:
            run = await store.run_id()
            fence = await store.create(
                self.proto.session_id, self.owner, token, self._grace(), state
            )
        except Exception as exc:
            # The store is down at the open: the session is served, resumable on this replica
            # only (its replies' `stored` stays null), as if opened without a store.
            log.warning("session store unreachable at open: %s", type(exc).__name__)
            return
        self.fence, self.store_run, self.last_state = fence, run, state
        self.token_digest = digest(token)
        self.keeper = asyncio.create_task(self._keep_lease())

    def _stored_state(self, frame: Frame | None = None) -> StoredSession:
        """The session as its last fold left it (call between turns, or right after one);
        `frame`: the chunk just answered, whose frame (if any, and retained) is stored with it.
        Notes the frames to write and to delete with this state (`frames_unwritten`,
        `frames_to_drop`)."""
        assert self.record is not None and self.proto.config is not None
        es = self.record.engine_session
        snapshot = es.snapshot
        kind: MediaKind | None = None
        if frame is not None and frame.kind != "text":
            kind = frame.kind
        media, new_index = held_media(self.media, snapshot, self.media_next, kind)
        if new_index is not None and frame is not None:
            self.frames_unwritten[new_index] = frame.data
            self.frames_held[new_index] = frame.data
        gone = {i for i in (*self.media, *self.frames_unwritten) if i not in media}
        for i in gone:
            if self.frames_unwritten.pop(i, None) is None:
                self.frames_to_drop.add(i)
        for i in [i for i in self.frames_held if i not in media]:
            del self.frames_held[i]
        self.media = media
        if snapshot is not None:
            self.media_next = snapshot.next_index
        return StoredSession(
            config=self.proto.config,
            frames_total=self.proto.frames_total,
            responses={str(k): v for k, v in self.proto.responses.items()},
            turn_open=es.turn_open,
            chunks=es.chunks,
            snapshot=snapshot,
            media=dict(media),
        )

    async def _claim_from_store(
        self, action: ResumeSession
    ) -> tuple[Connection, str, int | None] | None:
        """Claim the session in the store: its local holder (this replica held it) or a
        rebuilt one, the new token, and the tokens re-prefilled (None: not rebuilt). None if
        the store does not know the session (it may still be a local-only one)."""
        store = self.hub.store
        if store is None:
            return None
        token = new_token()
        try:
            claim = await store.claim(
                action.session_id,
                action.resume_token,
                self.owner,
                token,
                max(self.hub.config.max_resume_grace_s, 1.0),
            )
        except Exception as exc:
            # The store is unreachable: nothing was claimed, the token still works. Say so
            # with the code of "cannot serve now, retry" (as while draining), not a server bug.
            log.warning("session store claim failed: %s", type(exc).__name__)
            raise CapacityExceeded(
                "the session store is unreachable; retry session.resume shortly",
                event_id=action.event_id,
            ) from None
        if claim is None:
            return None
        assert self.resume_tokens is not None
        local = self.resume_tokens.holder(action.session_id)
        run = await self._run_id()
        if local is not None and not local.closed:
            local.fence = claim.fence  # the same replica takes it back: no rebuild
            local.token_digest, local.store_run = digest(token), run
            return local, token, None
        started = time.perf_counter()
        try:
            record, tokens = await self.hub.restore_session(
                action.session_id, claim.stored, self.owner, claim.frames
            )
        except Exception as exc:
            # No room (or no engine, or a rebuild refused) here: the presented token works
            # again elsewhere.
            try:
                await store.give_back(action.session_id, claim.fence, action.resume_token, 60.0)
            except Exception as store_exc:
                log.warning("session store give-back failed: %s", type(store_exc).__name__)
            if not isinstance(exc, RealtimeError):
                log.exception("session rebuild failed")
                exc = EngineError("the session could not be rebuilt on this server")
            exc.event_id = exc.event_id or action.event_id
            raise exc from None
        holder = Connection(
            self.ws, self.hub, self.owner, self.lifecycle, self.resume_tokens, self.connections
        )
        holder.proto = record.protocol
        holder.record = record
        holder.fence = claim.fence
        holder.token_digest, holder.store_run = digest(token), run
        holder.last_state = claim.stored
        holder.media = dict(claim.stored.media)  # their bytes are in the store already
        holder.frames_held = dict(claim.frames)
        snapshot = claim.stored.snapshot
        holder.media_next = 0 if snapshot is None else snapshot.next_index
        holder.parked = True  # take_over attaches it, as a parked one
        self.hub.metrics.sessions_parked.inc()
        took = time.perf_counter() - started
        self.hub.metrics.rebuild_seconds.observe(took)
        self.hub.metrics.rebuild_tokens.inc(tokens)
        log.info(
            "session rebuilt id=%s tokens=%d in %.3f s (fence %d)",
            action.session_id[:12],
            tokens,
            took,
            claim.fence,
        )
        return holder, token, tokens

    async def _keep_lease(self) -> None:
        """While this replica holds a stored session: refresh its hash, and let the session
        go as soon as another replica has claimed it (the fence moved on)."""
        store = self.hub.store
        assert store is not None
        period = min(1.0, self._grace() / 4)
        while not self.closed and self.fence is not None:
            await asyncio.sleep(period)
            try:
                held = await store.refresh(self.proto.session_id, self.fence, self._grace())
                if held and not self.store_ok:
                    await self._rewrite()  # Redis is back: the folds it missed, at once
                elif not held:
                    held = await self._recreate_if_lost()
            except Exception as exc:  # the store is down: keep serving, try again
                if self.store_ok:
                    log.warning("session store refresh failed: %s", type(exc).__name__)
                self.store_ok = False
                continue
            if not held:
                self.keeper = None  # _let_go's finish must not cancel the task it runs in
                await self._let_go()
                return

    async def _run_id(self) -> str | None:
        store = self.hub.store
        try:
            return None if store is None else await store.run_id()
        except Exception:
            return None

    async def _rewrite(self) -> None:
        """Write the last fold again (a write failed while the store was down)."""
        async with self.store_lock:
            if not self.store_ok and self.last_state is not None:
                await self._write(self.last_state)

    async def _recreate_if_lost(self, *, locked: bool = False) -> bool:
        """The fenced call was refused. If Redis restarted without this session's hash, write
        it whole again and go on holding it (True); else another replica holds it (False).
        `locked`: the caller holds `store_lock`."""
        store = self.hub.store
        if store is None or self.fence is None or self.token_digest is None:
            return False
        if self.last_state is None or not await store.lost(self.proto.session_id, self.store_run):
            return False
        if locked:
            return await self._recreate()
        async with self.store_lock:
            return await self._recreate()

    async def _recreate(self) -> bool:
        store = self.hub.store
        assert store is not None and self.fence is not None and self.token_digest is not None
        assert self.last_state is not None
        run = await store.run_id()
        done = await store.recreate(
            self.proto.session_id,
            self.owner,
            self.token_digest,
            self.fence,
            self._grace(),
            self.last_state,
            self.frames_held,
        )
        if done:
            self.store_run, self.store_ok = run, True
            self.frames_unwritten.clear()
            self.frames_to_drop.clear()
            log.info(
                "session store restarted without id=%s: its record is written again",
                self.proto.session_id[:12],
            )
        return bool(done)

    async def _let_go(self) -> None:
        """Another replica claimed this session: stop serving it here, write nothing more."""
        if self.closed:
            return
        log.info("session taken over elsewhere id=%s", self.proto.session_id[:12])
        self.fence = None
        socket_gone = self.parked or self.ws.client_state != WebSocketState.CONNECTED
        if not socket_gone:
            await self.send_error(SessionNotFound("this session was resumed on another connection"))
        await self.finish(self.proto.server_close("error"), socket_gone=socket_gone)

    async def _still_held(self) -> bool:
        """Before a chunk: whether this replica still holds its stored session (a replica
        whose lease moved on must not run one more chunk: no second writer, ever)."""
        store = self.hub.store
        if self.fence is None or store is None:
            return True
        try:
            if await store.refresh(self.proto.session_id, self.fence, self._grace()):
                return True
            return await self._recreate_if_lost()
        except Exception:
            self.store_ok = False
            return True  # the store is down: the fenced write after the fold still guards

    async def _persist(self, state: StoredSession) -> bool:
        """Write a fold's state (`state`, taken right after the turn); whether it is stored."""
        self.store_seq += 1
        async with self.store_lock:
            return await self._write(state)

    async def _persist_consolidated(self, state: StoredSession) -> None:
        """Once more after an idle consolidation (the snapshot then holds the consolidated
        window), unless a later fold was written meanwhile."""
        seq = self.store_seq
        es = self.record.engine_session if self.record is not None else None
        if es is not None and es.consolidating and self.fence is not None:
            await es.settle()
            async with self.store_lock:
                if seq == self.store_seq and es.snapshot is not None:
                    # The consolidation dropped remnants: a frame cut by eviction goes now.
                    fresh = self._stored_state()
                    await self._write(
                        dataclasses.replace(state, snapshot=fresh.snapshot, media=fresh.media)
                    )

    async def _write(self, state: StoredSession) -> bool:
        """Write `state` (fenced); whether the store now holds it. A store that does not
        answer: False, and the session goes on (`store_ok` False until a write succeeds)."""
        store = self.hub.store
        if store is None or self.fence is None:
            return False
        self.last_state = state
        frames, drop = dict(self.frames_unwritten), set(self.frames_to_drop)
        try:
            ok = await store.write(
                self.proto.session_id,
                self.fence,
                state,
                self._grace(),
                frames=frames,
                drop_frames=sorted(drop),
            )
            if not ok and await self._recreate_if_lost(locked=True):
                return True  # written whole (last_state is this state)
        except Exception as exc:
            if self.store_ok:
                log.warning("session store write failed: %s", type(exc).__name__)
            self.store_ok = False
            return False
        if ok:
            for i in frames:
                self.frames_unwritten.pop(i, None)
            self.frames_to_drop -= drop
            if not self.store_ok:
                log.info("session store written again id=%s", self.proto.session_id[:12])
            self.store_ok = True
        self.hub.metrics.store_bytes_per_fold.observe(store.bytes_written_last)
        if not ok:
            await self._let_go()
        return ok

    async def _run_turn(self, action: SubmitFrame) -> None:
        assert self.record is not None
        frame = action.frame
        if frame.reply:  # an ingested chunk (reply: false) has no reply to announce
            await self.send(
                ResponseCreatedEvent(frame_index=frame.frame_index, frame_id=frame.frame_id)
            )
        try:
            if not await self._still_held():
                self.turn = None  # _let_go's finish must not cancel the task it runs in
                await self._let_go()
                return
            outcome = await self.hub.run_turn(
                self.record, frame, on_delta=self.send, cancelled=self.cancelled
            )
            if outcome.close_reason == "engine_error" and not await self.hub.check_engine():
                log.error("engine is down; ending session id=%s", self.proto.session_id[:12])
                if await self.hand_over_lost_engine():
                    return
            stored = None
            done = outcome.done
            if self.fence is not None and outcome.close_reason is None:
                # Written before response.done: a client that has its reply can resume it.
                stored = self._stored_state(frame)
                written = await self._persist(stored)
                done = done.model_copy(update={"stored": written})
                if self.proto.missed_response is outcome.done:
                    self.proto.missed_response = done
            await self.send(done)
            if stored is not None:
                await self._persist_consolidated(stored)
            if outcome.error is not None:
                await self.send_error(outcome.error)
            if outcome.close_reason == "engine_error" and not await self.hub.check_engine():
                log.error("engine is down; closing session")
            if outcome.close_reason is not None:
                await self.finish(self.proto.server_close(outcome.close_reason))
        except Exception:
            # Not a protocol error: a server bug. Without this the accepted chunk never got its
            # response.done and the task's exception went unretrieved.
            log.exception("turn failed")
            await self.send_error(InternalError("internal server error"))
            await self.finish(self.proto.server_close("error"))
        finally:
            self.last_activity = time.monotonic()
            if self.draining and not self.closed:
                await self.finish(self.proto.server_close("server_shutdown"))

    # -- graceful drain (realtime/drain.py)

    async def begin_drain(self, seconds_left: float) -> None:
        """The server is shutting down: say so, and close now unless a reply is in flight
        (then `_run_turn` closes right after its response.done)."""
        if self.closed or self.draining:
            return
        self.draining = True
        # A stored session is handed over: its record stays in the store (its last fold is
        # written before the close), and the client resumes it on another replica.
        handover = self.fence is not None
        await self.send(ServerDrainingEvent(seconds_left=round(seconds_left, 3), handover=handover))
        if self.turn is None or self.turn.done():
            await self.finish(self.proto.server_close("server_shutdown"))

    async def hand_over_lost_engine(self) -> bool:
        """The engine died. A session whose record in the store is at its last fold is handed
        over as a drain hands it over (`server.draining` with `handover`, `session.closed`
        `server_shutdown`, the record kept), so the client resumes it on another replica; the
        chunk in flight gets no response.done here: the resumed session's `next_frame_index`
        is that chunk's, and the client sends it again. False: not stored, or the store missed
        a fold (the caller ends it with engine_error)."""
        if self.closed:
            return self.lost_engine
        if self.fence is None or not self.store_ok:
            return False
        self.draining = self.lost_engine = True
        log.warning("engine died: session handed over id=%s", self.proto.session_id[:12])
        await self.send(ServerDrainingEvent(seconds_left=0.0, handover=True))
        await self.finish(self.proto.server_close("server_shutdown"), socket_gone=self.parked)
        return True

    async def close_for_shutdown(self) -> None:
        """The drain's deadline passed: cancel the reply in flight and close."""
        await self.finish(self.proto.server_close("server_shutdown"))

    async def finish(self, close: CloseSession | None, *, socket_gone: bool = False) -> None:
        """Close the session once: stop the turn, free the engine request, say goodbye."""
        if close is None and self.closed:
            return
        self.closed = True
        self._unpark()
        keeper, self.keeper = self.keeper, None
        if keeper is not None and keeper is not asyncio.current_task():
            keeper.cancel()
        fence, self.fence = self.fence, None
        handover = self.draining and close is not None and close.reason == "server_shutdown"
        if fence is not None and self.hub.store is not None and not handover:
            # Closed or expired here: nothing of it stays (fenced: not if it moved on).
            with contextlib.suppress(Exception):
                await self.hub.store.delete(self.proto.session_id, fence)
        if self.resume_tokens is not None:
            self.resume_tokens.forget(self.proto.session_id)
        if self.connections is not None:
            self.connections.discard(self)
        turn, self.turn = self.turn, None
        if turn is not None and not turn.done() and turn is not asyncio.current_task():
            # Cancelling the consumer inside generate() makes vLLM abort the request.
            self.cancelled.set()
            turn.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await turn
        if self.proto.in_flight is not None and not self.lost_engine:
            # An accepted chunk always gets its response.done, even when the session ends
            # (but for a dead engine's hand-over: the chunk is sent again after the resume).
            failed = close is not None and close.reason == "engine_error"
            status: ResponseStatus = "failed" if failed else "cancelled"
            reason = close.reason if close is not None else "disconnect"
            await self.send(self.proto.response_finished(status, status_reason=reason))
        if self.record is not None:
            await self.hub.close_session(self.record)
        if close is not None and not socket_gone:
            await self.send(close.event)
        if not socket_gone and self.ws.client_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await self.ws.close(code=1000)
