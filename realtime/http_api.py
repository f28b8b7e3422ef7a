"""The HTTP session adapter (`/v1/streaming/sessions`): a thin transport over `Session`.

An HTTP session is a `realtime.session.Session`, the same object a WebSocket session is: its
protocol machine, its engine session (the hub's record, `transport="http"`: the same registry
and admission) and its store writer; a frame runs the same turn (`Session.run_turn`, then
`Session.store_turn`), and the `TurnOutcome.close_reason` decides, as for a socket, whether a
failed turn ends the session. One request carries one frame; the response is that frame's
response.done.

The routes read their bodies themselves (`read_body`: refused past the size limit before they
are buffered, errors in the protocol's `error` shape, not FastAPI's 422), so FastAPI does not
see the body types; `openapi_extra` and `responses` name them for /openapi.json, and
`document_request_bodies` puts the request models into its components (docs/http.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from realtime.drain import Lifecycle
from realtime.hub import SessionHub
from realtime.session import Session
from realtime.web import dump, error_response, http_key, read_body, status_for
from vllm_realtime_protocol import (
    ChunkInFlight,
    ErrorEvent,
    FrameAppendEvent,
    InvalidEvent,
    OpenSession,
    RealtimeError,
    ResponseDoneEvent,
    SessionClosedEvent,
    SessionConfig,
    SessionNotFound,
    SessionOpenedEvent,
    SessionOpenEvent,
    SessionProtocol,
    SubmitFrame,
)


class HttpSessionClosed(BaseModel):
    """Answer to DELETE for a session that was already closing (no session.closed to give)."""

    session_id: str = Field(description="Id of the session.")
    closed: Literal[True] = Field(default=True, description="Always true.")


class HttpFrameError(ErrorEvent):
    """A frame whose turn failed: the `error`, and the response.done recorded for the frame."""

    response: ResponseDoneEvent | None = Field(
        default=None, description="The frame's response.done (status 'failed'), when there is one."
    )


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorEvent, "description": "invalid_request (and other request errors)"},
    401: {"model": ErrorEvent, "description": "unauthorized: missing or wrong API key"},
    413: {"model": ErrorEvent, "description": "frame_too_large: the body is over the limit"},
    429: {
        "model": ErrorEvent,
        "description": "capacity_exceeded (also while draining)",
    },
    503: {"model": ErrorEvent, "description": "engine_error"},
}
_OPEN_BODY = {
    "requestBody": {
        "required": False,
        "description": "The session's settings; an empty body takes every default.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/SessionConfig"}}},
    }
}
_FRAME_BODY = {
    "requestBody": {
        "required": True,
        "description": "One frame: a text/* body is a text turn, any other body an image "
        "(JPEG, PNG, WebP) in the session's frame_format.",
        "content": {
            "text/plain": {"schema": {"type": "string"}},
            "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}

# What /openapi.json says of each route (FastAPI does not see the bodies the routes read).
_OPEN_DOC: dict[str, Any] = {
    "summary": "Open an HTTP session",
    "description": "The body is a SessionConfig (the fields of session.open); the answer is "
    "session.opened, whose session_id the frame and close routes take.",
    "responses": {200: {"model": SessionOpenedEvent, "description": "session.opened"}, **_ERRORS},
    "openapi_extra": _OPEN_BODY,
}
_FRAME_DOC: dict[str, Any] = {
    "summary": "Send one frame and wait for its reply",
    "description": "One frame.append: the body is the frame, ?prompt= the question asked of it "
    "(none: the session's default prompt). Answers when the reply is done.",
    "responses": {
        200: {"model": ResponseDoneEvent, "description": "the frame's response.done"},
        404: {"model": ErrorEvent, "description": "session_not_found"},
        409: {"model": ErrorEvent, "description": "chunk_in_flight: a frame is in flight"},
        **{code: _ERRORS[code] for code in (400, 401, 413)},
        503: {"model": HttpFrameError, "description": "engine_error; the session is closed"},
    },
    "openapi_extra": _FRAME_BODY,
}
_CLOSE_DOC: dict[str, Any] = {
    "summary": "Close an HTTP session",
    "description": "Close the session and free its KV blocks.",
    "responses": {
        200: {
            "model": SessionClosedEvent | HttpSessionClosed,
            "description": "session.closed (reason client_closed)",
        },
        401: _ERRORS[401],
        404: {"model": ErrorEvent, "description": "session_not_found"},
    },
}

# Inbound models that routes read themselves, for `document_request_bodies`.
REQUEST_MODELS: tuple[type[BaseModel], ...] = (SessionConfig,)


def document_request_bodies(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Add `models` (validation schemas) to the app's OpenAPI components, where the routes'
    `openapi_extra` request bodies refer to them; FastAPI adds only the models it parses."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = default_openapi()
        _, defs = models_json_schema(
            [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, body in defs.get("$defs", {}).items():
            components.setdefault(name, body)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


class _OpenedSession(NamedTuple):
    session: Session
    body: dict[str, Any]  # its session.opened


class HttpSessions:
    """The open HTTP sessions of one server, by id. The hub's registry says which are open (its
    idle reaper and the drain close HTTP sessions there); this maps each to its `Session`."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def add(self, session: Session) -> None:
        hub = session.hub
        # Forget the sessions the hub closed meanwhile (idle, drain, a dead engine).
        for sid, held in list(self._sessions.items()):
            if hub.sessions.get(sid) is not held.record:
                del self._sessions[sid]
        self._sessions[session.session_id] = session

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def find(self, hub: SessionHub, session_id: str, key: str | None) -> Session:
        """The open session `session_id` that `key` may act on (else session_not_found)."""
        try:
            record = hub.find(session_id, key, "http")
        except SessionNotFound:
            if session_id not in hub.sessions:  # closed by the hub (not: another key's)
                self._sessions.pop(session_id, None)
            raise
        session = self._sessions.get(session_id)
        if session is None or session.record is not record:
            raise SessionNotFound("no such session")
        return session

    async def close(self, session: Session) -> None:
        """End the session: nothing of it stays in the store, its engine request is freed."""
        self._sessions.pop(session.session_id, None)
        session.closed = True
        await session.stop_storing(keep_record=False)
        if session.record is not None:
            await session.hub.close_session(session.record)


def http_router(
    lifecycle: Lifecycle, require_key: Callable[[Request], JSONResponse | None]
) -> APIRouter:
    """The adapter's routes; `require_key(request)` answers a request without a valid key."""
    router = APIRouter()
    sessions = HttpSessions()

    def hub_of(request: Request) -> SessionHub:
        hub: SessionHub = request.app.state.hub
        return hub

    @router.post("/v1/streaming/sessions", **_OPEN_DOC)
    async def http_open(request: Request) -> JSONResponse:
        if (denied := require_key(request)) is not None:
            return denied
        try:
            opened = await _opened(request, hub_of(request), lifecycle)
            sessions.add(opened.session)
            return JSONResponse(opened.body)
        except RealtimeError as exc:
            return error_response(exc, status_for(exc))

    @router.post("/v1/streaming/sessions/{session_id}/frame", **_FRAME_DOC)
    async def http_frame(
        request: Request, session_id: str, prompt: str | None = None
    ) -> JSONResponse:
        if (denied := require_key(request)) is not None:
            return denied
        try:
            session = sessions.find(hub_of(request), session_id, http_key(request))
            return await _frame(request, session, sessions, prompt)
        except RealtimeError as exc:
            return error_response(exc, status_for(exc))

    @router.delete("/v1/streaming/sessions/{session_id}", **_CLOSE_DOC)
    async def http_close(request: Request, session_id: str) -> JSONResponse:
        if (denied := require_key(request)) is not None:
            return denied
        try:
            session = sessions.find(hub_of(request), session_id, http_key(request))
        except RealtimeError as exc:
            return error_response(exc, 404)
        close = session.protocol.server_close("server_shutdown")
        await sessions.close(session)
        if close is None:
            return JSONResponse(HttpSessionClosed(session_id=session_id).model_dump(mode="json"))
        closed = close.event.model_copy(update={"reason": "client_closed"})
        return JSONResponse(closed.model_dump(mode="json"))

    return router


async def _opened(request: Request, hub: SessionHub, lifecycle: Lifecycle) -> _OpenedSession:
    """session.open over HTTP: the open session and its session.opened body; a refusal raises
    RealtimeError."""
    raw = await read_body(request, hub.limits().max_event_bytes)
    try:
        session_config = SessionConfig.model_validate_json(raw) if raw.strip() else SessionConfig()
    except ValueError as exc:
        raise InvalidEvent(f"session config: {str(exc)[:300]}") from None
    lifecycle.check_admitting()
    session = Session(hub, http_key(request))
    proto = session.protocol
    # dict(model), not model_dump(exclude_none=True): dropping nulls turned an explicit
    # `retention.window_chunks: null` ("no cap") back into the default 8.
    action = proto.receive_client_event(SessionOpenEvent(**dict(session_config)))
    assert isinstance(action, OpenSession)
    if action.config.resumable is not None:
        raise InvalidEvent(
            "session config: resumable is for WebSocket sessions (an HTTP session "
            "outlives its requests anyway)"
        )
    hub.ensure_text_or_video(action.config)
    record = await hub.open_session(proto, action.config, session.owner, "http")
    session.record = record
    opened = action.event.model_copy(update={"reservation": hub.reservation(record)})
    return _OpenedSession(session, opened.model_dump(mode="json"))


async def _frame(
    request: Request, session: Session, sessions: HttpSessions, prompt: str | None
) -> JSONResponse:
    """One frame of an open session, answered when its reply is done (one at a time)."""
    record = session.record
    assert record is not None
    if record.lock.locked():
        raise ChunkInFlight("a chunk of this session is in flight")
    async with record.lock:
        frame = (await _submitted_frame(request, session.protocol, prompt)).frame
        ended = await session.run_turn(frame)  # the outcome is this request's answer
        if ended is None:
            # Its stored record moved on (another replica claimed it): it ends here.
            await sessions.close(session)
            raise SessionNotFound("this session was resumed elsewhere")
        if ended.error is None:
            return JSONResponse(dump(ended.done))
        if ended.close_reason is not None:
            # The session is over (engine_error, context_exceeded): not listed any more.
            await sessions.close(session)
        return error_response(
            ended.error,
            status_for(ended.error),  # engine_error: 503
            extra={"response": dump(ended.done)},
        )


async def _submitted_frame(
    request: Request, proto: SessionProtocol, prompt: str | None
) -> SubmitFrame:
    """The request body as one frame.append (text/* bodies are text, anything else binary)."""
    body = await read_body(request, proto.limits.max_frame_bytes)
    if request.headers.get("content-type", "").startswith("text/"):
        if not body:
            # FrameAppendEvent(text="") raised pydantic's ValidationError: a 500.
            raise InvalidEvent("frame.text: the request body is empty")
        event = FrameAppendEvent(text=body.decode("utf-8", "replace"), prompt=prompt)
        action = proto.receive_client_event(event)
    else:
        proto.receive_client_event(FrameAppendEvent(binary=True, prompt=prompt))
        action = proto.receive_binary(body)
    assert isinstance(action, SubmitFrame)
    return action
