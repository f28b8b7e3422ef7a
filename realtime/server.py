"""The FastAPI app: routes, lifespan, watchdog, and `run_server`.

Every route is a thin transport over one `SessionHub` (realtime/hub.py: the one session
registry, admission, the turn runner): `/v1/realtime` (WebSocket, realtime/connection.py), the
HTTP adapter (realtime/http_api.py), plus `/health`, `/metrics`, client secrets and the demo
page. Fail-closed: shutdown drains, and so does an engine failure, with no time left.

A dead engine (docs/reliability.md; the watchdog looks once a second, and a turn that meets it
hands its own session over at once): the server drains with no time left (realtime/drain.py,
`drain_dead_engine`): stored sessions are handed over (`server.draining` with `handover`, their
record kept), the others get `engine_error`; then the process exits with
`ENGINE_DEAD_EXIT_STATUS`, so a supervisor's restart policy brings the replica back, unless
`--keep-alive-on-engine-death` (vLLM's `VLLM_KEEP_ALIVE_ON_ENGINE_DEATH`) keeps it up, answering
503 on /health and `engine_error` to new sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

from realtime.client_secrets import SECRET_PREFIX, ClientSecrets
from realtime.config import ServerConfig
from realtime.connection import Connection
from realtime.drain import Lifecycle, drain, drain_dead_engine
from realtime.http_api import REQUEST_MODELS, document_request_bodies, http_router
from realtime.hub import SessionHub
from realtime.resumption import ResumeTokens
from realtime.web import (
    error_response,
    http_key,
    install_log_redaction,
    key_accepted,
    read_body,
    redact_path,
    status_for,
)
from vllm_realtime_protocol import (
    ClientSecret,
    ClientSecretRequest,
    ErrorEvent,
    InvalidEvent,
    RealtimeError,
    SessionConfig,
    Unauthorized,
    api_key_from_handshake,
    select_subprotocol,
)

__all__ = ["Connection", "create_app", "redact_path", "run_server"]

WS_IMPLEMENTATION = "websockets-sansio"
"""uvicorn's WebSocket implementation: its sans-I/O one over the `websockets` protocol (the
legacy one is deprecated by uvicorn). It pauses reading a socket until the app took the message
before, and a send waits while the socket's write buffer is full: a client that never reads
holds its own connection, not the server's memory (tests/scale_out/test_engine_death.py)."""


log = logging.getLogger("vllm_realtime")
STATIC_DIR = Path(__file__).parent / "static"
ENGINE_DEAD_EXIT_STATUS = 3
"""The server's exit status after its engine died (not 1: a crash of the server itself)."""
ENGINE_DEAD_EXIT_DEADLINE_S = 30.0
"""At most this long from finding the engine dead to the process's exit, whatever hangs (the
hand-over, uvicorn's stop, the dead engine's stop): a timer then exits the process."""
ENGINE_DEAD_DRAIN_S = 10.0
"""At most this long for a dead engine's drain before the server stops anyway: a socket that
takes nothing (a client that never reads) must not hold the exit up."""
_redact_path = redact_path  # the name the security tests know


@dataclass(frozen=True)
class EngineDeathExit:
    """How a serve process leaves once its engine died: `arm` starts the timer that exits it
    with ENGINE_DEAD_EXIT_STATUS at the latest ENGINE_DEAD_EXIT_DEADLINE_S later (from the
    moment the engine is found dead); `stop` ends uvicorn's loop once sessions are handed
    over (run_server then stops what is left of the engine and exits with that status)."""

    arm: Callable[[], None]
    stop: Callable[[], None]


class _App:
    """The app's shared state: the hub (set by the lifespan), connections, drain, secrets."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.connections: set[Connection] = set()
        self.lifecycle = Lifecycle(config.drain_timeout_s)
        self.resume_tokens: ResumeTokens[Connection] = ResumeTokens()
        self.client_secrets = ClientSecrets()
        # Set once the engine is found dead; `exit_on_engine_death` (set by run_server unless
        # the operator keeps the server up) then stops the server.
        self.engine_dead_at: float | None = None
        self.exit_on_engine_death: EngineDeathExit | None = None

    def require_key(self, request: Request) -> JSONResponse | None:
        if key_accepted(self.config, http_key(request)):
            return None
        return error_response(Unauthorized("missing or wrong API key"), 401)


def _hub(request: Request | WebSocket) -> SessionHub:
    hub: SessionHub = request.app.state.hub
    return hub


def create_app(hub_factory: Callable[[], Awaitable[SessionHub]], config: ServerConfig) -> FastAPI:
    """`hub_factory()` → an awaitable SessionHub (started engine); called in the lifespan."""
    shared = _App(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hub = await hub_factory()
        app.state.hub = hub
        watchdog = asyncio.create_task(_watch(hub, shared))
        try:
            yield
        finally:
            watchdog.cancel()
            for conn in list(shared.connections):
                await conn.finish(conn.proto.server_close("server_shutdown"))
            for record in list(hub.sessions.values()):
                await hub.close_session(record)
            if hub.store is not None:
                await hub.store.close()

    # /openapi.json and /docs (Swagger UI) are open: they hold the routes' schemas, nothing of
    # a session or a key (docs/http.md). The old reason for turning them off was only that they
    # would be open routes. One set of schemas (validation), since the HTTP adapter's request
    # bodies are referred to by name (realtime/http_api.py).
    app = FastAPI(
        title="vllm-realtime",
        summary="Realtime streaming sessions on vLLM: WebSocket /v1/realtime (docs/protocol.md) "
        "and the HTTP adapter /v1/streaming/sessions (docs/http.md).",
        lifespan=lifespan,
        redoc_url=None,
        separate_input_output_schemas=False,
    )
    document_request_bodies(app, (*REQUEST_MODELS, ClientSecretRequest))
    install_log_redaction()
    _add_status_routes(app, shared)
    _add_realtime_routes(app, shared)
    app.include_router(http_router(shared.lifecycle, shared.require_key))

    async def drain_app() -> None:
        """Stop admitting, tell every connection, let replies finish, close (drain.py)."""
        hub: SessionHub = app.state.hub
        await drain(
            shared.lifecycle, shared.connections, hub.of_transport("http"), hub.close_session
        )
        for record in list(hub.sessions.values()):
            await hub.close_session(record)

    app.state.lifecycle = shared.lifecycle
    app.state.resume_tokens = shared.resume_tokens
    app.state.client_secrets = shared.client_secrets
    app.state.connections = shared.connections
    app.state.drain = drain_app
    app.state.shared = shared
    if STATIC_DIR.is_dir():
        # The demo page's assets. realtime-client.js there is a symlink to clients/js (one source
        # of truth), hence follow_symlink; paths still cannot climb out of the directory.
        app.mount("/static", StaticFiles(directory=STATIC_DIR, follow_symlink=True), name="static")
    return app


def _add_status_routes(app: FastAPI, shared: _App) -> None:
    """/health (open), /metrics (keyed) and the demo page."""

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        hub = _hub(request)
        ok = await hub.check_engine()
        body = {"status": "ok" if ok else "engine_down", "sessions": len(hub.sessions)}
        if not ok:
            body["reason"] = hub.engine_failure or "unknown"
        elif shared.lifecycle.draining:
            # Load balancers stop routing here; the sessions still open are finishing.
            body["status"] = "draining"
            return JSONResponse(body, status_code=503)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if (denied := shared.require_key(request)) is not None:
            return denied
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        hub = _hub(request)
        # From the sessions' last reports: reading /metrics costs no engine call.
        hub.metrics.kv_blocks_held.set(hub.kv_blocks_held())
        return PlainTextResponse(
            generate_latest(hub.metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST
        )

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        page = STATIC_DIR / "index.html"
        if page.exists():
            return FileResponse(page)
        return PlainTextResponse("vllm-realtime: connect a WebSocket to /v1/realtime\n")


def _add_realtime_routes(app: FastAPI, shared: _App) -> None:
    """/v1/realtime (WebSocket) and the client secrets it accepts instead of the API key."""

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        offered = [p for p in ws.scope.get("subprotocols", [])]
        key = api_key_from_handshake(ws.headers.get("authorization"), offered)
        bound: SessionConfig | None = None
        if key is not None and key.startswith(SECRET_PREFIX):
            # A client secret: live, or refused (also on a server without API keys).
            grant = shared.client_secrets.redeem(key)
            if grant is None:
                await ws.close(code=1008)
                return
            key, bound = grant.owner, grant.session
        elif not key_accepted(shared.config, key):
            # Refuse in the handshake: the client learns 403, nothing else.
            await ws.close(code=1008)
            return
        draining = shared.lifecycle.draining or not _hub(ws).healthy
        if draining and shared.config.session_store is not None:
            # Replicas share a session store: a draining one (or one whose engine died) refuses
            # the handshake with 503, so the router sends the connection (a session.resume
            # after server.draining, too) to another replica (docker/nginx/realtime.conf:
            # proxy_next_upstream http_503).
            await ws.send_denial_response(JSONResponse({"status": "draining"}, status_code=503))
            return
        await ws.accept(subprotocol=select_subprotocol(offered))
        conn = Connection(
            ws, _hub(ws), key, shared.lifecycle, shared.resume_tokens, shared.connections, bound
        )
        shared.connections.add(conn)
        try:
            resumed = await conn.run()
            while resumed is not None:  # session.resume: this socket now serves that session
                conn = resumed
                resumed = await conn.serve_resumed()
        finally:
            if conn.closed:
                # A parked connection stays listed (the drain and the watchdog reach it).
                shared.connections.discard(conn)

    @app.post(
        "/v1/realtime/client_secrets",
        summary="Mint a client secret",
        responses={200: {"model": ClientSecret}, 401: {"model": ErrorEvent}},
        openapi_extra={
            "requestBody": {
                "required": False,
                "content": {
                    "application/json": {
                        "schema": {"$ref": "#/components/schemas/ClientSecretRequest"}
                    }
                },
            }
        },
    )
    async def mint_client_secret(request: Request) -> JSONResponse:
        """A short-lived browser credential (realtime/client_secrets.py); needs the API key."""
        if (denied := shared.require_key(request)) is not None:
            return denied
        config = shared.config
        try:
            body = await _client_secret_request(request, _hub(request).model_name)
        except RealtimeError as exc:
            return error_response(exc, status_for(exc))
        ttl = min(body.expires_in_s or config.client_secret_ttl_s, config.max_client_secret_ttl_s)
        secret = shared.client_secrets.mint(http_key(request), ttl, body.session)
        answer = ClientSecret(
            client_secret=secret,
            expires_at=time.time() + ttl,
            expires_in_s=ttl,
            session=body.session,
        )
        return JSONResponse(answer.model_dump(mode="json"))


async def _client_secret_request(request: Request, model_name: str) -> ClientSecretRequest:
    raw = await read_body(request, 1 << 20)
    try:
        body = (
            ClientSecretRequest.model_validate_json(raw) if raw.strip() else ClientSecretRequest()
        )
    except ValueError as exc:
        raise InvalidEvent(f"client secret request: {str(exc)[:300]}") from None
    if body.session is not None and body.session.model not in (None, model_name):
        raise InvalidEvent(f"session.model: this server serves {model_name!r}")
    return body


WATCH_PERIOD_S = 1.0


async def _watch(hub: SessionHub, shared: _App) -> None:
    """Every second: engine alive? idle HTTP sessions past their timeout are closed."""
    while True:
        await asyncio.sleep(WATCH_PERIOD_S)
        try:
            await _watch_once(hub, shared)
        except Exception:
            # One failed round must not end the watchdog (it used to die silently).
            log.exception("watchdog round failed")


async def _watch_once(hub: SessionHub, shared: _App) -> None:
    if not await hub.check_engine():
        await _engine_died(hub, shared)
        return
    now = time.monotonic()
    for record in hub.of_transport("http").values():
        if not record.lock.locked() and now - record.last_activity > hub.config.idle_timeout_s:
            await hub.close_session(record)


async def _engine_died(hub: SessionHub, shared: _App) -> None:
    """Drain with no time left (realtime/drain.py, `drain_dead_engine`): stored sessions are
    handed over, the others end with engine_error, HTTP sessions are closed; then stop the
    server (unless it is kept up)."""
    first = shared.engine_dead_at is None
    leaving = shared.exit_on_engine_death if first else None
    if first:
        shared.engine_dead_at = time.monotonic()
        if leaving is not None:
            leaving.arm()
    elif not shared.connections and not hub.of_transport("http"):
        return  # kept up: nothing opened since the last round
    try:
        await asyncio.wait_for(
            drain_dead_engine(
                shared.lifecycle,
                shared.connections,
                hub.of_transport("http"),
                hub.close_session,
                hub.engine_failure or "unknown",
            ),
            timeout=ENGINE_DEAD_DRAIN_S,
        )
    except TimeoutError:
        log.warning(
            "the dead engine's drain took over %.0f s (a socket that takes nothing?); going on",
            ENGINE_DEAD_DRAIN_S,
        )
    if leaving is not None:
        log.error("the engine is gone: stopping the server")
        leaving.stop()


async def _started_hub(engine: Any, config: ServerConfig, model_name: str) -> SessionHub:
    hub = SessionHub(engine, config, model_name=model_name)
    await hub.start()
    return hub


def _exit_now(status: int) -> None:
    """End the process at once, its log flushed. After the engine died nothing of it is left to
    stop cleanly, and the interpreter's own teardown took 6 s more here (2-core machine:
    docs/history/engine-death.md), all of it time before the supervisor's restart.
    multiprocessing's resource tracker, a process of its own, still frees the shared memory
    left behind once this process's end closes its pipe."""
    log.error("exiting with status %d", status)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _draining_server(app: FastAPI, config: ServerConfig) -> Any:
    """uvicorn's server for `app`, stopped through the app's drain (realtime/drain.py)."""
    import uvicorn

    from realtime.drain import DrainingServer
    from vllm_realtime_protocol import DEFAULT_MAX_EVENT_BYTES

    return DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            workers=1,
            log_level="info",
            ws=WS_IMPLEMENTATION,
            # uvicorn's own WebSocket cap (16 MiB) equalled limits.max_event_bytes, so a text
            # message over the limit was never answered with the documented frame_too_large:
            # the socket closed with 1009 instead. A margin makes the documented answer
            # reachable.
            ws_max_size=DEFAULT_MAX_EVENT_BYTES + (1 << 20),
            # After the drain only idle HTTP keep-alives are left.
            timeout_graceful_shutdown=5,
        ),
        app.state.drain,
    )


def run_server(config: ServerConfig, settings: Any) -> int:
    """Start the engine and serve until interrupted (one process: the registry is per process);
    the exit status (0, or `ENGINE_DEAD_EXIT_STATUS` once the engine died)."""
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
    server = _draining_server(app, config)
    server.on_force(app.state.lifecycle.forced.set)
    shared: _App = app.state.shared
    armed: list[threading.Timer] = []

    def arm() -> None:
        """Whatever hangs once the engine died, the process exits: a supervisor's restart
        policy is what brings the replica back."""
        if not armed:
            deadline = threading.Timer(
                ENGINE_DEAD_EXIT_DEADLINE_S, os._exit, (ENGINE_DEAD_EXIT_STATUS,)
            )
            deadline.daemon = True  # a normal exit does not wait for it
            deadline.start()
            armed.append(deadline)

    if not config.keep_alive_on_engine_death:
        stop = functools.partial(setattr, server, "should_exit", True)
        shared.exit_on_engine_death = EngineDeathExit(arm=arm, stop=stop)
    try:
        server.run()
    finally:
        if shared.engine_dead_at is not None:
            arm()  # kept up until a signal stopped it: the same bound from here
        # Stop EngineCore and its worker (vLLM sends SIGTERM and waits); before, SIGTERM killed
        # the server first and left them running, reparented to init.
        for engine in engines:
            log.info("shutting the engine down")
            stopping = time.monotonic()
            # vLLM's default grace (5 s) is shorter than its CPU worker's own exit (3-5 s seen),
            # after which the EngineCore was SIGKILLed; give them the time to exit cleanly. A
            # dead engine has nothing left to stop cleanly.
            engine.shutdown(timeout=15 if shared.engine_dead_at is None else 2)
            log.info("engine shut down in %.1f s", time.monotonic() - stopping)
        if shared.engine_dead_at is not None:
            _exit_now(ENGINE_DEAD_EXIT_STATUS)
        # AsyncLLM.__del__ shuts down once more; left to the interpreter's teardown it ran with
        # vLLM's module globals already cleared and printed a TypeError traceback.
        dead = shared.engine_dead_at is not None
        del app, server, hub_factory, shared
        engines.clear()
        gc.collect()
    return ENGINE_DEAD_EXIT_STATUS if dead else 0
