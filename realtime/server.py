"""FastAPI app: `/v1/realtime` (WebSocket), the HTTP session adapter, `/health`, `/metrics`.

This module only moves events between sockets, the sans-I/O `SessionProtocol` and the session
hub. Fail-closed: a disconnect aborts the session (its KV blocks are freed), an engine failure
closes every session with an `error`, shutdown closes sessions cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
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
    CloseSession,
    EngineError,
    ErrorEvent,
    FrameAppendEvent,
    IdleTimeout,
    InvalidEvent,
    OpenSession,
    RealtimeError,
    ResponseCreatedEvent,
    ResponseStatus,
    ServerEvent,
    SessionConfig,
    SessionNotFound,
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
from realtime.config import ServerConfig
from realtime.hub import SessionHub, SessionRecord

log = logging.getLogger("vllm_realtime")
STATIC_DIR = Path(__file__).parent / "static"


def _key_ok(expected: str | None, given: str | None) -> bool:
    if expected is None:
        return True
    return given is not None and hmac.compare_digest(expected.encode(), given.encode())


class Connection:
    """One WebSocket connection: its protocol state, its session, its turn task."""

    def __init__(self, ws: WebSocket, hub: SessionHub, owner: str | None) -> None:
        self.ws = ws
        self.hub = hub
        self.owner = owner
        self.proto: SessionProtocol = hub.new_protocol()
        self.record: SessionRecord | None = None
        self.turn: asyncio.Task[None] | None = None
        self.cancelled = asyncio.Event()
        self.send_lock = asyncio.Lock()
        self.closed = False

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

    async def run(self) -> None:
        await self.send(self.proto.greeting())
        try:
            while not self.closed:
                try:
                    message = await asyncio.wait_for(self.ws.receive(), timeout=self._timeout())
                except asyncio.TimeoutError:
                    await self.send_error(IdleTimeout("no client event within the idle timeout"))
                    await self.finish(self.proto.server_close("idle_timeout"))
                    return
                if message["type"] == "websocket.disconnect":
                    raise WebSocketDisconnect(message.get("code", 1000))
                await self.handle(dict(message))
        except WebSocketDisconnect:
            await self.finish(self.proto.server_close("disconnect"), socket_gone=True)
        finally:
            await self.finish(self.proto.server_close("disconnect"), socket_gone=True)

    def _timeout(self) -> float | None:
        # A turn in flight is the server's business, not the client's idleness.
        if self.turn is not None and not self.turn.done():
            return None
        return self.hub.config.idle_timeout_s

    async def handle(self, message: dict[str, Any]) -> None:
        try:
            if message.get("bytes") is not None:
                action: Any = self.proto.receive_binary(message["bytes"])
            else:
                text = message.get("text")
                event = parse_client_event(
                    text if text is not None else b"", max_bytes=self.proto.limits.max_event_bytes
                )
                action = self.proto.receive_client_event(event)
        except RealtimeError as exc:
            await self.send_error(exc)
            if not exc.session_survives:
                await self.finish(self.proto.server_close("error"))
            return
        await self.carry_out(action)

    async def carry_out(self, action: Any) -> None:
        if isinstance(action, OpenSession):
            try:
                self.hub.ensure_text_or_video(action.config)
                self.record = await self.hub.open_session(self.proto, action.config, self.owner)
            except RealtimeError as exc:
                self.proto.open_refused()
                await self.send_error(exc)
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

    async def _run_turn(self, action: SubmitFrame) -> None:
        assert self.record is not None
        frame = action.frame
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

    async def finish(self, close: CloseSession | None, *, socket_gone: bool = False) -> None:
        """Close the session once: stop the turn, free the engine request, say goodbye."""
        if close is None and self.closed:
            return
        self.closed = True
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

    app = FastAPI(title="vllm-realtime", lifespan=lifespan)

    def hub_of(request: Request | WebSocket) -> SessionHub:
        hub: SessionHub = request.app.state.hub
        return hub

    def http_key(request: Request) -> str | None:
        return bearer_token(request.headers.get("authorization"))

    def require_key(request: Request) -> JSONResponse | None:
        if _key_ok(config.api_key, http_key(request)):
            return None
        return _error_response(Unauthorized("missing or wrong API key"), 401)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        hub = hub_of(request)
        ok = await hub.check_engine()
        body = {"status": "ok" if ok else "engine_down", "sessions": len(hub.sessions)}
        if not ok:
            body["reason"] = hub.engine_failure or "unknown"
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
        if not _key_ok(config.api_key, key):
            # Refuse in the handshake: the client learns 403, nothing else.
            await ws.close(code=1008)
            return
        await ws.accept(subprotocol=select_subprotocol(offered))
        conn = Connection(ws, hub, key)
        connections.add(conn)
        try:
            await conn.run()
        finally:
            connections.discard(conn)

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
            raw = await request.body()
            try:
                session_config = (
                    SessionConfig.model_validate_json(raw) if raw.strip() else SessionConfig()
                )
            except ValueError as exc:
                raise InvalidEvent(f"session config: {str(exc)[:300]}") from None
            from protocol import SessionOpenEvent

            proto = hub.new_protocol()
            open_event = SessionOpenEvent(**session_config.model_dump(exclude_none=True))
            action = proto.receive_client_event(open_event)
            assert isinstance(action, OpenSession)
            hub.ensure_text_or_video(action.config)
            record = await hub.open_session(proto, action.config, http_key(request))
        except RealtimeError as exc:
            return _error_response(exc, _status_for(exc))
        http_sessions[proto.session_id] = record
        return JSONResponse(action.event.model_dump(mode="json"))

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
                body = await request.body()
                prompt = request.query_params.get("prompt")
                ctype = request.headers.get("content-type", "")
                proto = record.protocol
                if ctype.startswith("text/"):
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
        if not await hub.check_engine():
            for conn in list(connections):
                if conn.proto.state is not State.CLOSED:
                    await conn.send_error(EngineError(f"the engine is down: {hub.engine_failure}"))
                    await conn.finish(conn.proto.server_close("engine_error"))
        now = time.monotonic()
        http_sessions: dict[str, SessionRecord] = app.state.http_sessions
        for sid, record in list(http_sessions.items()):
            if not record.lock.locked() and now - record.last_activity > hub.config.idle_timeout_s:
                http_sessions.pop(sid, None)
                await hub.close_session(record)


def run_server(config: ServerConfig, settings: Any) -> None:
    """Start the engine and serve until interrupted (one process: the registry is per process)."""
    import uvicorn

    from realtime.engine import start_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    async def hub_factory() -> SessionHub:
        engine = start_engine(settings)
        hub = SessionHub(engine, config, model_name=settings.model)
        await hub.start()
        return hub

    app = create_app(hub_factory, config)
    uvicorn.run(
        app, host=config.host, port=config.port, workers=1, log_level="info", ws="websockets"
    )
