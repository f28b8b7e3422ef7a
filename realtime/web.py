"""HTTP plumbing shared by the routes: API keys, bodies, error responses, log redaction."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from realtime.config import ServerConfig
from realtime.hub import key_matches
from vllm_realtime_protocol import FrameTooLarge, RealtimeError, bearer_token, error_event


def key_accepted(config: ServerConfig, given: str | None) -> bool:
    """Whether `given` is one of the server's keys (always true when none is configured)."""
    keys = config.accepted_keys()
    if not keys:
        return True
    # Compare with every key (no early exit), so timing does not tell which one nearly matched.
    return sum(key_matches(k, given) for k in keys) > 0


def http_key(request: Request) -> str | None:
    return bearer_token(request.headers.get("authorization"))


_SESSION_ID = re.compile(r"(sess_[0-9a-f]{7})[0-9a-f]+")


def redact_path(path: str) -> str:
    """A request path fit for a log: no query string (the HTTP adapter takes `?prompt=`, and
    clients put keys there against the docs), session ids cut to the 12 characters the hub
    logs (a full id is a capability on a server without API keys)."""
    return _SESSION_ID.sub(r"\1…", path.split("?", 1)[0])


class RedactRequestPaths(logging.Filter):
    """uvicorn logs request lines (`uvicorn.access`) and WebSocket upgrades (`uvicorn.error`)
    with the full path; found by tests/reliability/test_security.py::test_logs_hold_no_payloads."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(
                redact_path(a) if isinstance(a, str) and a.startswith("/") else a
                for a in record.args
            )
        return True


def install_log_redaction() -> None:
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactRequestPaths) for f in logger.filters):
            logger.addFilter(RedactRequestPaths())


async def read_body(request: Request, limit: int) -> bytes:
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


def dump(event: Any) -> Any:
    return None if event is None else event.model_dump(mode="json")


def _dump(event: Any) -> Any:
    return None if event is None else event.model_dump(mode="json")


def status_for(exc: RealtimeError) -> int:
    return {
        "session_not_found": 404,
        "chunk_in_flight": 409,
        "capacity_exceeded": 429,
        "rate_limited": 429,
        "frame_too_large": 413,
        "unauthorized": 401,
        "engine_error": 503,
    }.get(exc.code, 400 if exc.type == "invalid_request_error" else 500)


def error_response(
    exc: RealtimeError, status: int, extra: dict[str, Any] | None = None
) -> JSONResponse:
    body = error_event(exc).model_dump(mode="json")
    if extra:
        body.update(extra)
    return JSONResponse(body, status_code=status)
