"""Short-lived client secrets: the browser's credential, so the API key never reaches a page.

Theory of operation: a backend that holds the API key calls `POST /v1/realtime/client_secrets`
and hands the page the secret it gets back; the page offers it as its subprotocol credential
(`vllm-realtime.auth.<secret>`), exactly where an API key would go. A secret opens WebSocket
connections until it expires (default 60 s; a connection that is open when it expires goes on)
and acts as the API key that minted it (same owner: sessions per key, resumption). It may be
bound to a session config: a connection made with it opens that session, whatever its
`session.open` asks. It is good for nothing else (not the HTTP adapter, not `/metrics`, not
minting more secrets). Only a SHA-256 digest is kept, in this process: a restart forgets them.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

from vllm_realtime_protocol import SessionConfig

SECRET_PREFIX = "ek_"
"""Every client secret starts with this; an API key must not (the server refuses such keys)."""


@dataclass(frozen=True)
class Grant:
    """What a client secret stands for."""

    owner: str | None
    session: SessionConfig | None
    expires_at: float  # time.monotonic()


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


class ClientSecrets:
    def __init__(self) -> None:
        self._grants: dict[bytes, Grant] = {}

    def __len__(self) -> int:
        return len(self._grants)

    def mint(self, owner: str | None, ttl_s: float, session: SessionConfig | None) -> str:
        self._prune()
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)  # 256 bits
        self._grants[_digest(secret)] = Grant(owner, session, time.monotonic() + ttl_s)
        return secret

    def redeem(self, secret: str | None) -> Grant | None:
        """The grant of a live secret; None for an unknown or expired one."""
        if not secret or not secret.startswith(SECRET_PREFIX):
            return None
        grant = self._grants.get(_digest(secret))
        if grant is None or grant.expires_at <= time.monotonic():
            return None
        return grant

    def _prune(self) -> None:
        now = time.monotonic()
        for digest in [d for d, g in self._grants.items() if g.expires_at <= now]:
            del self._grants[digest]
