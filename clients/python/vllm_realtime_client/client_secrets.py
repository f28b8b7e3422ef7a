"""Mint a browser credential: ``POST /v1/realtime/client_secrets`` with the API key.

A backend that holds the API key mints a short-lived secret and hands it to a browser, which
offers it as the ``vllm-realtime.auth.<secret>`` subprotocol (docs/protocol.md, "Browser
credentials").  The key itself never reaches the browser.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from vllm_realtime_client.errors import ConnectError, RealtimeError, error_from_detail
from vllm_realtime_protocol.codec import parse_server_event
from vllm_realtime_protocol.events import (
    ClientSecret,
    ClientSecretRequest,
    ErrorEvent,
    SessionConfig,
)

PATH = "/v1/realtime/client_secrets"


def secrets_url(server: str) -> str:
    """The endpoint for a server given as ``http(s)://host:port`` or as its WebSocket URL."""
    parts = urlsplit(server)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    if scheme not in ("http", "https"):
        raise ValueError(f"expected an http(s):// or ws(s):// URL, got {server!r}")
    return urlunsplit((scheme, parts.netloc, PATH, "", ""))


def mint_client_secret_sync(
    server: str,
    api_key: str,
    *,
    expires_in_s: float | None = None,
    session: SessionConfig | Mapping[str, Any] | None = None,
    timeout: float = 10.0,
) -> ClientSecret:
    """Blocking :func:`mint_client_secret`."""
    body = ClientSecretRequest(
        expires_in_s=expires_in_s,
        session=SessionConfig.model_validate(session) if isinstance(session, Mapping) else session,
    )
    request = urllib.request.Request(
        secrets_url(server),
        data=body.model_dump_json(exclude_none=True).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return ClientSecret.model_validate_json(response.read())
    except urllib.error.HTTPError as exc:
        raise _refusal(exc.read(), exc.code) from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectError(f"could not reach {secrets_url(server)}: {exc}") from exc


async def mint_client_secret(
    server: str,
    api_key: str,
    *,
    expires_in_s: float | None = None,
    session: SessionConfig | Mapping[str, Any] | None = None,
    timeout: float = 10.0,
) -> ClientSecret:
    """A short-lived secret for a browser.  ``session`` binds it to one session config
    (``session.open`` then opens exactly that); ``expires_in_s`` is capped by the server.
    A refusal raises the protocol's error (e.g. :class:`~vllm_realtime_protocol.errors.Unauthorized`)."""
    return await asyncio.to_thread(
        mint_client_secret_sync,
        server,
        api_key,
        expires_in_s=expires_in_s,
        session=session,
        timeout=timeout,
    )


def _refusal(raw: bytes, status: int) -> RealtimeError | ConnectError:
    try:
        event = parse_server_event(raw)
    except RealtimeError:
        text = raw[:200].decode("utf-8", "replace")
        return ConnectError(f"HTTP {status} from the client-secret endpoint: {text}")
    if isinstance(event, ErrorEvent):
        return error_from_detail(event.error)
    return ConnectError(f"HTTP {status}: unexpected {json.dumps(event.type)}")
