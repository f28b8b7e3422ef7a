"""The HTTP session adapter (`/v1/streaming/sessions`): a thin transport over the session hub.

An HTTP session is a hub session with `transport="http"`: the same registry, admission and turn
runner as a WebSocket session; the hub's `TurnOutcome.close_reason` decides, as for a socket,
whether a failed turn ends the session. One request carries one frame; the response is that
frame's response.done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from protocol import (
    ChunkInFlight,
    FrameAppendEvent,
    InvalidEvent,
    OpenSession,
    RealtimeError,
    SessionConfig,
    SessionOpenEvent,
    SubmitFrame,
)
from realtime.drain import Lifecycle
from realtime.hub import SessionHub, SessionRecord
from realtime.web import dump, error_response, http_key, read_body, status_for


def http_router(
    lifecycle: Lifecycle, require_key: Callable[[Request], JSONResponse | None]
) -> APIRouter:
    """The adapter's routes; `require_key(request)` answers a request without a valid key."""
    router = APIRouter()

    def hub_of(request: Request) -> SessionHub:
        hub: SessionHub = request.app.state.hub
        return hub

    @router.post("/v1/streaming/sessions")
    async def http_open(request: Request) -> JSONResponse:
        if (denied := require_key(request)) is not None:
            return denied
        hub = hub_of(request)
        try:
            raw = await read_body(request, hub.limits().max_event_bytes)
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
            action = proto.receive_client_event(SessionOpenEvent(**dict(session_config)))
            assert isinstance(action, OpenSession)
            if action.config.resumable is not None:
                raise InvalidEvent(
                    "session config: resumable is for WebSocket sessions (an HTTP session "
                    "outlives its requests anyway)"
                )
            hub.ensure_text_or_video(action.config)
            record = await hub.open_session(proto, action.config, http_key(request), "http")
        except RealtimeError as exc:
            return error_response(exc, status_for(exc))
        opened = action.event.model_copy(update={"reservation": hub.reservation(record)})
        return JSONResponse(opened.model_dump(mode="json"))

    @router.post("/v1/streaming/sessions/{session_id}/frame")
    async def http_frame(request: Request, session_id: str) -> JSONResponse:
        if (denied := require_key(request)) is not None:
            return denied
        hub = hub_of(request)
        try:
            record = hub.find(session_id, http_key(request), "http")
            if record.lock.locked():
                raise ChunkInFlight("a chunk of this session is in flight")
            async with record.lock:
                action = await _submitted_frame(request, record)
                outcome = await hub.run_turn(record, action.frame)
                if outcome.error is None:
                    return JSONResponse(dump(outcome.done))
                if outcome.close_reason is not None:
                    # The session is over (engine_error, context_exceeded): not listed any more.
                    await hub.close_session(record)
                return error_response(
                    outcome.error,
                    status_for(outcome.error),  # engine_error: 503
                    extra={"response": dump(outcome.done)},
                )
        except RealtimeError as exc:
            return error_response(exc, status_for(exc))

    @router.delete("/v1/streaming/sessions/{session_id}")
    async def http_close(request: Request, session_id: str) -> JSONResponse:
        if (denied := require_key(request)) is not None:
            return denied
        hub = hub_of(request)
        try:
            record = hub.find(session_id, http_key(request), "http")
        except RealtimeError as exc:
            return error_response(exc, 404)
        close = record.protocol.server_close("server_shutdown")
        await hub.close_session(record)
        body: dict[str, Any] = {"session_id": session_id, "closed": True}
        if close is not None:
            body = close.event.model_copy(update={"reason": "client_closed"}).model_dump(
                mode="json"
            )
        return JSONResponse(body)

    return router


async def _submitted_frame(request: Request, record: SessionRecord) -> SubmitFrame:
    """The request body as one frame.append (text/* bodies are text, anything else binary)."""
    body = await read_body(request, record.protocol.limits.max_frame_bytes)
    prompt = request.query_params.get("prompt")
    proto = record.protocol
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
