"""Resume tokens and client secrets without a server (realtime/resumption.py,
realtime/client_secrets.py)."""

from __future__ import annotations

import base64
import time

import pytest

from realtime.client_secrets import SECRET_PREFIX, ClientSecrets
from realtime.config import ServerConfig
from realtime.resumption import ResumeTokens
from vllm_realtime_protocol import SessionConfig, SessionNotFound


def _bits(token: str) -> int:
    return len(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))) * 8


def test_resume_tokens_are_bound_rotated_and_refused_alike() -> None:
    tokens: ResumeTokens[str] = ResumeTokens()
    first = tokens.issue("sess_a", "key-a", "holder-a")
    assert _bits(first) == 256
    assert tokens.claim("sess_a", first, "key-a", None) == "holder-a"
    refusals = []
    for sid, tok, owner in [
        ("sess_a", first + "x", "key-a"),  # wrong token
        ("sess_a", first, "key-b"),  # another key
        ("sess_a", first, None),  # no key
        ("sess_b", first, "key-a"),  # no such id
    ]:
        with pytest.raises(SessionNotFound) as info:
            tokens.claim(sid, tok, owner, "ev")
        refusals.append((info.value.code, info.value.message, info.value.event_id))
    assert len(set(refusals)) == 1  # nothing tells the cases apart
    second = tokens.issue("sess_a", "key-a", "holder-a")  # rotation, as at a resume
    assert second != first
    with pytest.raises(SessionNotFound):
        tokens.claim("sess_a", first, "key-a", None)
    tokens.forget("sess_a")
    with pytest.raises(SessionNotFound):
        tokens.claim("sess_a", second, "key-a", None)
    assert len(tokens) == 0


def test_resume_tokens_without_api_keys_bind_to_none() -> None:
    tokens: ResumeTokens[int] = ResumeTokens()
    token = tokens.issue("sess_a", None, 1)
    assert tokens.claim("sess_a", token, None, None) == 1
    with pytest.raises(SessionNotFound):
        tokens.claim("sess_a", token, "some-key", None)


def test_client_secrets_expire_and_carry_their_grant() -> None:
    store = ClientSecrets()
    bound = SessionConfig(instructions="only this")
    secret = store.mint("key-a", 0.2, bound)
    assert secret.startswith(SECRET_PREFIX) and _bits(secret[len(SECRET_PREFIX) :]) == 256
    grant = store.redeem(secret)
    assert grant is not None and grant.owner == "key-a" and grant.session == bound
    assert store.redeem("key-a") is None and store.redeem(None) is None
    assert store.redeem(SECRET_PREFIX + "made-up") is None
    time.sleep(0.25)
    assert store.redeem(secret) is None
    store.mint("key-a", 60, None)  # minting prunes the expired ones
    assert len(store) == 1


def test_api_keys_cannot_look_like_client_secrets() -> None:
    with pytest.raises(ValueError, match="must not start with"):
        ServerConfig(api_key=SECRET_PREFIX + "x")
    with pytest.raises(ValueError, match="client_secret_ttl_s"):
        ServerConfig(client_secret_ttl_s=700.0)
    with pytest.raises(ValueError, match="max_resume_grace_s"):
        ServerConfig(max_resume_grace_s=-1)
    with pytest.raises(ValueError, match="drain_timeout_s"):
        ServerConfig(drain_timeout_s=-1)
