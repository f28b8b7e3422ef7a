"""Reading the API key from a WebSocket handshake (pure functions, no I/O).

The server accepts a key two ways and no other:

* the ``Authorization: Bearer <key>`` header;
* the subprotocol ``vllm-realtime.auth.<key>``, offered next to
  ``vllm-realtime`` (for browsers, which cannot set headers):
  ``new WebSocket(url, ["vllm-realtime", "vllm-realtime.auth.<key>"])``.
  The server selects ``vllm-realtime`` and never echoes the key subprotocol.

A ``?api_key=`` query parameter is NOT accepted: URLs end up in logs.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_realtime_protocol.constants import AUTH_SUBPROTOCOL_PREFIX, SUBPROTOCOL

__all__ = [
    "api_key_from_handshake",
    "bearer_token",
    "key_from_subprotocols",
    "select_subprotocol",
]


def bearer_token(authorization: str | None) -> str | None:
    """The key in an ``Authorization: Bearer <key>`` header value, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def key_from_subprotocols(offered: Iterable[str]) -> str | None:
    """The key in an offered ``vllm-realtime.auth.<key>`` subprotocol, or None."""
    for proto in offered:
        proto = proto.strip()
        if proto.startswith(AUTH_SUBPROTOCOL_PREFIX) and len(proto) > len(AUTH_SUBPROTOCOL_PREFIX):
            return proto[len(AUTH_SUBPROTOCOL_PREFIX) :]
    return None


def api_key_from_handshake(
    authorization: str | None, offered_subprotocols: Iterable[str]
) -> str | None:
    """The client's key: the Bearer header wins over the auth subprotocol; None if neither."""
    return bearer_token(authorization) or key_from_subprotocols(offered_subprotocols)


def select_subprotocol(offered: Iterable[str]) -> str | None:
    """The subprotocol to accept: ``vllm-realtime`` if offered, else None (accept none)."""
    return SUBPROTOCOL if SUBPROTOCOL in {p.strip() for p in offered} else None
