"""FastAPI app: `/v1/realtime` (WebSocket), the HTTP session adapter, `/health`, `/metrics`.

This module only moves events between sockets, the sans-I/O `SessionProtocol` and the session
hub. Fail-closed: a disconnect aborts the session (its KV blocks are freed), an engine failure
closes every session with an `error`, shutdown closes sessions cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.websockets import WebSocketState

from protocol import (
    AwaitBinary,
    CancelResponse,
    ChunkInFlight,
    ClientSecret,
    ClientSecretRequest,
    CloseSession,
    EngineError,
    ErrorEvent,
    FrameAppendEvent,
    FrameTooLarge,
    IdleTimeout,
    InternalError,
    InvalidEvent,
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
    Unauthorized,
    api_key_from_handshake,
    bearer_token,
    encode_server_event,
    error_event,
    parse_client_event,
    select_subprotocol,
)
from realtime.client_secrets import SECRET_PREFIX, ClientSecrets
from realtime.config import ServerConfig
from realtime.drain import Lifecycle, drain
from realtime.hub import SessionHub, SessionRecord
from realtime.resumption import ResumeTokens

log = logging.getLogger("vllm_realtime")
STATIC_DIR = Path(__file__).parent / "static"


async def _close_quietly(ws: WebSocket, code: int) -> None:
    with contextlib.suppress(Exception):
        await ws.close(code=code)


def _key_ok(expected: str | None, given: str | None) -> bool:
    if expected is None:
        return True
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


def _key_accepted(config: ServerConfig, given: str | None) -> bool:
    """Whether `given` is one of the server's keys (always true when none is configured)."""
    keys = config.accepted_keys()
    if not keys:
        return True
    # Compare with every key (no early exit), so timing does not tell which one nearly matched.
    return sum(_key_ok(k, given) for k in keys) > 0


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


_SESSION_ID = re.compile(r"(sess_[0-9a-f]{7})[0-9a-f]+")


def _redact_path(path: str) -> str:
    """A request path fit for a log: no query string (the HTTP adapter takes `?prompt=`, and
    clients put keys there against the docs), session ids cut to the 12 characters the hub
    logs (a full id is a capability on a server without API keys)."""
    return _SESSION_ID.sub(r"\1…", path.split("?", 1)[0])


class _RedactRequestPaths(logging.Filter):
    """uvicorn logs request lines (`uvicorn.access`) and WebSocket upgrades (`uvicorn.error`)
    with the full path; found by tests/reliability/test_security.py::test_logs_hold_no_payloads."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(
                _redact_path(a) if isinstance(a, str) and a.startswith("/") else a
                for a in record.args
            )
        return True


def _install_log_redaction() -> None:
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RedactRequestPaths) for f in logger.filters):
            logger.addFilter(_RedactRequestPaths())


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with frame_too_large past `limit` bytes before it is all read
    (request.body() would buffer any size in memory first)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise FrameTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise FrameTooLarge(f"request body is over the limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)


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
        period; a reply in flight runs on and its response.done is kept (protocol.state)."""
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

    async def take_over(self, ws: WebSocket) -> None:
        """session.resume from `ws` was accepted: the session continues on that socket.

        Whether it was parked or its old socket still looks open (half-open TCP: the server
        has not seen the drop yet), the old socket is let go and never serves it again."""
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
        token = self.resume_tokens.issue(self.proto.session_id, self.owner, self)
        resumed = self.proto.resumed(token)
        self.hub.metrics.sessions_resumed.inc()
        log.info(
            "session resumed id=%s next_frame=%d missed_response=%s",
            self.proto.session_id[:12],
            resumed.next_frame_index,
            resumed.missed_response is not None,
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
                record = await self.hub.open_session(self.proto, action.config, self.owner)
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

    async def _resume(self, action: ResumeSession) -> None:
        """session.resume on this fresh connection: hand the socket to the session's holder."""
        try:
            self.lifecycle.check_admitting(action.event_id)
            if self.resume_tokens is None:
                raise SessionNotFound("this server keeps no resumable sessions")
            holder = self.resume_tokens.claim(
                action.session_id, action.resume_token, self.owner, action.event_id
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
        await holder.take_over(self.ws)

    async def _run_turn(self, action: SubmitFrame) -> None:
        assert self.record is not None
        frame = action.frame
        if frame.reply:  # an ingested chunk (reply: false) has no reply to announce
            await self.send(
                ResponseCreatedEvent(frame_index=frame.frame_index, frame_id=frame.frame_id)
            )
        try:
            async for event in self.hub.run_turn(self.record, frame, cancelled=self.cancelled):
                await self.send(event)
        except EngineError as exc:
            await self.send_error(exc)
            if not await self.hub.check_engine():
                log.error("engine is down; closing session")
            await self.finish(self.proto.server_close("engine_error"))
        except RealtimeError as exc:
            await self.send_error(exc)
            if not exc.session_survives:
                await self.finish(self.proto.server_close("error"))
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
        await self.send(ServerDrainingEvent(seconds_left=round(seconds_left, 3)))
        if self.turn is None or self.turn.done():
            await self.finish(self.proto.server_close("server_shutdown"))

    async def close_for_shutdown(self) -> None:
        """The drain's deadline passed: cancel the reply in flight and close."""
        await self.finish(self.proto.server_close("server_shutdown"))

    async def finish(self, close: CloseSession | None, *, socket_gone: bool = False) -> None:
        """Close the session once: stop the turn, free the engine request, say goodbye."""
        if close is None and self.closed:
            return
        self.closed = True
        self._unpark()
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
        if self.proto.in_flight is not None:
            # An accepted chunk always gets its response.done, even when the session ends.
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


def create_app(hub_factory: Any, config: ServerConfig) -> FastAPI:
    """`hub_factory()` → an awaitable SessionHub (started engine); called in the lifespan."""
    connections: set[Connection] = set()
    lifecycle = Lifecycle(config.drain_timeout_s)
    resume_tokens: ResumeTokens[Connection] = ResumeTokens()
    client_secrets = ClientSecrets()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hub: SessionHub = await hub_factory()
        app.state.hub = hub
        watchdog = asyncio.create_task(_watch(hub, connections, app))
        try:
            yield
        finally:
            watchdog.cancel()
            for conn in list(connections):
                await conn.finish(conn.proto.server_close("server_shutdown"))
            for record in list(hub.sessions.values()):
                await hub.close_session(record)

    # No /docs, /redoc, /openapi.json: every route but /health and the demo page needs the key
    # (docs/protocol.md), and FastAPI's generated pages would be open ones.
    app = FastAPI(
        title="vllm-realtime", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    _install_log_redaction()

    def hub_of(request: Request | WebSocket) -> SessionHub:
        hub: SessionHub = request.app.state.hub
        return hub

    def http_key(request: Request) -> str | None:
        return bearer_token(request.headers.get("authorization"))

    def require_key(request: Request) -> JSONResponse | None:
        if _key_accepted(config, http_key(request)):
            return None
        return _error_response(Unauthorized("missing or wrong API key"), 401)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        hub = hub_of(request)
        ok = await hub.check_engine()
        body = {"status": "ok" if ok else "engine_down", "sessions": len(hub.sessions)}
        if not ok:
            body["reason"] = hub.engine_failure or "unknown"
        elif lifecycle.draining:
            # Load balancers stop routing here; the sessions still open are finishing.
            body["status"] = "draining"
            return JSONResponse(body, status_code=503)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if (denied := require_key(request)) is not None:
            return denied
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        hub = hub_of(request)
        with contextlib.suppress(Exception):
            from retention.vllm_adapter.introspect import kv_stats

            stats = await kv_stats(hub.engine)
            held = sum(stats["blocks_by_request"].get(sid, 0) for sid in hub.sessions)
            hub.metrics.kv_blocks_held.set(held)
        return PlainTextResponse(
            generate_latest(hub.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST
        )

    @app.get("/")
    async def index() -> Response:
        page = STATIC_DIR / "index.html"
        if page.exists():
            return FileResponse(page)
        return PlainTextResponse("vllm-realtime: connect a WebSocket to /v1/realtime\n")

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        hub = hub_of(ws)
        offered = [p for p in ws.scope.get("subprotocols", [])]
        key = api_key_from_handshake(ws.headers.get("authorization"), offered)
        bound: SessionConfig | None = None
        if key is not None and key.startswith(SECRET_PREFIX):
            # A client secret: live, or refused (also on a server without API keys).
            grant = client_secrets.redeem(key)
            if grant is None:
                await ws.close(code=1008)
                return
            key, bound = grant.owner, grant.session
        elif not _key_accepted(config, key):
            # Refuse in the handshake: the client learns 403, nothing else.
            await ws.close(code=1008)
            return
        await ws.accept(subprotocol=select_subprotocol(offered))
        conn = Connection(ws, hub, key, lifecycle, resume_tokens, connections, bound)
        connections.add(conn)
        try:
            resumed = await conn.run()
            while resumed is not None:  # session.resume: this socket now serves that session
                conn = resumed
                resumed = await conn.serve_resumed()
        finally:
            if conn.closed:
                # A parked connection stays listed (the drain and the watchdog reach it).
                connections.discard(conn)

    @app.post("/v1/realtime/client_secrets")
    async def mint_client_secret(request: Request) -> JSONResponse:
        """A short-lived browser credential (realtime/client_secrets.py); needs the API key."""
        if (denied := require_key(request)) is not None:
            return denied
        try:
            raw = await _read_body(request, 1 << 20)
            try:
                body = (
                    ClientSecretRequest.model_validate_json(raw)
                    if raw.strip()
                    else ClientSecretRequest()
                )
            except ValueError as exc:
                raise InvalidEvent(f"client secret request: {str(exc)[:300]}") from None
            if body.session is not None and body.session.model not in (
                None,
                hub_of(request).model_name,
            ):
                raise InvalidEvent(
                    f"session.model: this server serves {hub_of(request).model_name!r}"
                )
        except RealtimeError as exc:
            return _error_response(exc, _status_for(exc))
        ttl = min(body.expires_in_s or config.client_secret_ttl_s, config.max_client_secret_ttl_s)
        secret = client_secrets.mint(http_key(request), ttl, body.session)
        answer = ClientSecret(
            client_secret=secret,
            expires_at=time.time() + ttl,
            expires_in_s=ttl,
            session=body.session,
        )
        return JSONResponse(answer.model_dump(mode="json"))

    # -- HTTP adapter over the same session layer

    http_sessions: dict[str, SessionRecord] = {}

    def find_http_session(request: Request, session_id: str) -> SessionRecord:
        record = http_sessions.get(session_id)
        # Someone else's session answers exactly like a missing one: ids are not probeable.
        if record is None or not _key_ok(record.owner, http_key(request)):
            raise SessionNotFound("no such session")
        return record

    @app.post("/v1/streaming/sessions")
    async def http_open(request: Request) -> JSONResponse:
        if (denied := require_key(request)) is not None:
            return denied
        hub = hub_of(request)
        try:
            raw = await _read_body(request, hub.limits().max_event_bytes)
            try:
                session_config = (
                    SessionConfig.model_validate_json(raw) if raw.strip() else SessionConfig()
                )
            except ValueError as exc:
                raise InvalidEvent(f"session config: {str(exc)[:300]}") from None
            lifecycle.check_admitting()
            proto = hub.new_protocol()
            # dict(model), not model_dump(exclude_none=True): dropping nulls turned an explicit
            # `retention.window_chunks: null` ("no cap") back into the default 8.
            open_event = SessionOpenEvent(**dict(session_config))
            action = proto.receive_client_event(open_event)
            assert isinstance(action, OpenSession)
            if action.config.resumable is not None:
                raise InvalidEvent(
                    "session config: resumable is for WebSocket sessions (an HTTP session "
                    "outlives its requests anyway)"
                )
            hub.ensure_text_or_video(action.config)
            record = await hub.open_session(proto, action.config, http_key(request))
        except RealtimeError as exc:
            return _error_response(exc, _status_for(exc))
        http_sessions[proto.session_id] = record
        opened = action.event.model_copy(update={"reservation": hub.reservation(record)})
        return JSONResponse(opened.model_dump(mode="json"))

    @app.post("/v1/streaming/sessions/{session_id}/frame")
    async def http_frame(request: Request, session_id: str) -> JSONResponse:
        if (denied := require_key(request)) is not None:
            return denied
        hub = hub_of(request)
        try:
            record = find_http_session(request, session_id)
            if record.lock.locked():
                raise ChunkInFlight("a chunk of this session is in flight")
            async with record.lock:
                body = await _read_body(request, record.protocol.limits.max_frame_bytes)
                prompt = request.query_params.get("prompt")
                ctype = request.headers.get("content-type", "")
                proto = record.protocol
                if ctype.startswith("text/"):
                    if not body:
                        # FrameAppendEvent(text="") raised pydantic's ValidationError: a 500.
                        raise InvalidEvent("frame.text: the request body is empty")
                    event = FrameAppendEvent(text=body.decode("utf-8", "replace"), prompt=prompt)
                    action = proto.receive_client_event(event)
                else:
                    proto.receive_client_event(FrameAppendEvent(binary=True, prompt=prompt))
                    action = proto.receive_binary(body)
                assert isinstance(action, SubmitFrame)
                done: Any = None
                try:
                    async for ev in hub.run_turn(record, action.frame):
                        done = ev
                except EngineError as exc:
                    http_sessions.pop(session_id, None)
                    await hub.close_session(record)
                    return _error_response(exc, 503, extra={"response": _dump(done)})
                except RealtimeError as exc:
                    if not exc.session_survives:
                        # Fatal (context_exceeded): the session is over; it used to stay listed.
                        http_sessions.pop(session_id, None)
                        await hub.close_session(record)
                    return _error_response(exc, _status_for(exc), extra={"response": _dump(done)})
                return JSONResponse(_dump(done))
        except RealtimeError as exc:
            return _error_response(exc, _status_for(exc))

    @app.delete("/v1/streaming/sessions/{session_id}")
    async def http_close(request: Request, session_id: str) -> JSONResponse:
        if (denied := require_key(request)) is not None:
            return denied
        try:
            record = find_http_session(request, session_id)
        except RealtimeError as exc:
            return _error_response(exc, 404)
        http_sessions.pop(session_id, None)
        close = record.protocol.server_close("server_shutdown")
        await hub_of(request).close_session(record)
        body: dict[str, Any] = {"session_id": session_id, "closed": True}
        if close is not None:
            body = close.event.model_copy(update={"reason": "client_closed"}).model_dump(
                mode="json"
            )
        return JSONResponse(body)

    app.state.http_sessions = http_sessions

    async def drain_app() -> None:
        """Stop admitting, tell every connection, let replies finish, close (drain.py)."""
        hub: SessionHub = app.state.hub
        await drain(lifecycle, connections, http_sessions, hub.close_session)
        for record in list(hub.sessions.values()):
            await hub.close_session(record)

    app.state.lifecycle = lifecycle
    app.state.resume_tokens = resume_tokens
    app.state.client_secrets = client_secrets
    app.state.connections = connections
    app.state.drain = drain_app
    if STATIC_DIR.is_dir():
        # The demo page's assets. realtime-client.js there is a symlink to clients/js (one source
        # of truth), hence follow_symlink; paths still cannot climb out of the directory.
        app.mount("/static", StaticFiles(directory=STATIC_DIR, follow_symlink=True), name="static")
    return app


def _dump(event: Any) -> Any:
    return None if event is None else event.model_dump(mode="json")


def _status_for(exc: RealtimeError) -> int:
    return {
        "session_not_found": 404,
        "chunk_in_flight": 409,
        "capacity_exceeded": 429,
        "rate_limited": 429,
        "frame_too_large": 413,
        "unauthorized": 401,
        "engine_error": 503,
    }.get(exc.code, 400 if exc.type == "invalid_request_error" else 500)


def _error_response(
    exc: RealtimeError, status: int, extra: dict[str, Any] | None = None
) -> JSONResponse:
    body = error_event(exc).model_dump(mode="json")
    if extra:
        body.update(extra)
    return JSONResponse(body, status_code=status)


async def _watch(hub: SessionHub, connections: set[Connection], app: FastAPI) -> None:
    """Every few seconds: engine alive? idle HTTP sessions past their timeout are closed."""
    while True:
        await asyncio.sleep(2.0)
        try:
            await _watch_once(hub, connections, app)
        except Exception:
            # One failed round must not end the watchdog (it used to die silently).
            log.exception("watchdog round failed")


async def _watch_once(hub: SessionHub, connections: set[Connection], app: FastAPI) -> None:
    http_sessions: dict[str, SessionRecord] = app.state.http_sessions
    if not await hub.check_engine():
        for conn in list(connections):
            if conn.proto.state is not State.CLOSED:
                await conn.send_error(EngineError(f"the engine is down: {hub.engine_failure}"))
                await conn.finish(conn.proto.server_close("engine_error"))
        # HTTP sessions too: they used to stay registered until their idle timeout.
        for sid, record in list(http_sessions.items()):
            if not record.lock.locked():
                http_sessions.pop(sid, None)
                await hub.close_session(record)
    now = time.monotonic()
    for sid, record in list(http_sessions.items()):
        if not record.lock.locked() and now - record.last_activity > hub.config.idle_timeout_s:
            http_sessions.pop(sid, None)
            await hub.close_session(record)


async def _started_hub(engine: Any, config: ServerConfig, model_name: str) -> SessionHub:
    hub = SessionHub(engine, config, model_name=model_name)
    await hub.start()
    return hub


def run_server(config: ServerConfig, settings: Any) -> None:
    """Start the engine and serve until interrupted (one process: the registry is per process)."""
    import uvicorn

    from realtime.engine import start_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    engines: list[Any] = []  # for the shutdown after uvicorn returns

    async def hub_factory() -> SessionHub:
        # No local names the engine: a traceback captured during the engine's start (somewhere
        # in vLLM's start-up) kept this frame, hence the engine, alive until the interpreter's
        # teardown, where AsyncLLM.__del__ failed on cleared module globals.
        engines.append(start_engine(settings))
        return await _started_hub(engines[-1], config, settings.model)

    app = create_app(hub_factory, config)
    # uvicorn's own WebSocket cap (16 MiB) equalled limits.max_event_bytes, so a text message
    # over the limit was never answered with the documented frame_too_large: the socket closed
    # with 1009 instead. A margin over the limit makes the documented answer reachable.
    from protocol import DEFAULT_MAX_EVENT_BYTES
    from realtime.drain import DrainingServer

    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            workers=1,
            log_level="info",
            ws="websockets",
            ws_max_size=DEFAULT_MAX_EVENT_BYTES + (1 << 20),
            # After the drain only idle HTTP keep-alives are left.
            timeout_graceful_shutdown=5,
        ),
        app.state.drain,
    )
    server.on_force(app.state.lifecycle.forced.set)
    try:
        server.run()
    finally:
        # Stop EngineCore and its worker (vLLM sends SIGTERM and waits); before, SIGTERM killed
        # the server first and left them running, reparented to init.
        for engine in engines:
            log.info("shutting the engine down")
            # vLLM's default grace (5 s) is shorter than its CPU worker's own exit (3-5 s seen),
            # after which the EngineCore was SIGKILLed; give them the time to exit cleanly.
            engine.shutdown(timeout=15)
        # AsyncLLM.__del__ shuts down once more; left to the interpreter's teardown it ran with
        # vLLM's module globals already cleared and printed a TypeError traceback.
        del app, server, hub_factory
        engines.clear()
        gc.collect()
