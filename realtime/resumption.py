"""Resume tokens of resumable sessions (issue #20): issue, check, rotate, forget.

Theory of operation: a session opened with `resumable` outlives its WebSocket. When the socket
drops, the server parks the session (its engine request, KV and admission reservation stay) for
its grace period; a new connection that presents the session id and its resume token, under the
same API key, takes the session over. The token is the capability: 256 random bits, kept here
only as a SHA-256 digest, bound to the API key that opened the session, rotated at every resume
(the one used becomes worthless). A session is registered for its whole life, attached or
parked: a client may resume before the server has noticed that the old socket is dead (a
half-open TCP connection), and then takes the session from it.

With a session store (`serve --session-store`, realtime/session_store.py) the store is the
authority for stored sessions: it checks and rotates the token for every replica, and this
registry only finds the local holder of a session the store handed to this replica.

Every refusal is the same `session_not_found`, for an unknown id, a wrong token, another key or
an expired session alike, so the answer does not tell whether the id exists.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Generic, TypeVar

from vllm_realtime_protocol import SessionNotFound

T = TypeVar("T")

_NOT_RESUMABLE = "no resumable session with this id and token (unknown, expired, or not yours)"


def new_token() -> str:
    """A fresh resume token: 256 random bits."""
    return secrets.token_urlsafe(32)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def _same(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is b
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass
class _Entry(Generic[T]):
    holder: T
    owner: str | None
    digest: bytes


class ResumeTokens(Generic[T]):
    """Resumable sessions of one server by id, each with its holder (the server's Connection)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry[T]] = {}
        # Compared against when the id is unknown, so both paths do the same work.
        self._decoy = _digest(secrets.token_urlsafe(32))

    def __len__(self) -> int:
        return len(self._entries)

    def issue(self, session_id: str, owner: str | None, holder: T, token: str | None = None) -> str:
        """Register (or re-register, rotating the token) a session; the new token (`token`:
        one already issued through the session store)."""
        token = token or new_token()
        self._entries[session_id] = _Entry(holder, owner, _digest(token))
        return token

    def claim(self, session_id: str, token: str, owner: str | None, event_id: str | None) -> T:
        """The holder of `session_id` if `token` and `owner` match; `session_not_found` if not.

        The token stays valid until the caller rotates it with `issue` (on success) or the
        session is forgotten."""
        entry = self._entries.get(session_id)
        expected = entry.digest if entry is not None else self._decoy
        token_ok = hmac.compare_digest(expected, _digest(token))
        owner_ok = entry is not None and _same(entry.owner, owner)
        if entry is None or not (token_ok and owner_ok):
            raise SessionNotFound(_NOT_RESUMABLE, event_id=event_id)
        return entry.holder

    def holder(self, session_id: str) -> T | None:
        """The local holder of `session_id`, unchecked (the session store checked the token)."""
        entry = self._entries.get(session_id)
        return None if entry is None else entry.holder

    def forget(self, session_id: str) -> None:
        self._entries.pop(session_id, None)
