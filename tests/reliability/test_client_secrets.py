"""Browser credentials (issue #20): `POST /v1/realtime/client_secrets` mints a short-lived secret
that opens WebSocket connections as the API key that minted it, and nothing else."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import websockets

from tests.realtime.conftest import RunningServer, _serve
from tests.reliability.conftest import SUBPROTOCOLS, drain_until_closed, open_session, recv

pytestmark = pytest.mark.slow

KEY_A = {"Authorization": "Bearer key-a"}


@pytest.fixture(scope="module")
async def secrets_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    async for s in _serve(
        vlm_engine,
        "key-a",
        api_keys=("key-b",),
        max_sessions=4,
        max_sessions_per_key=1,
        client_secret_ttl_s=30.0,
        max_client_secret_ttl_s=120.0,
    ):
        yield s


async def mint(srv: RunningServer, body: dict[str, Any] | None = None, **kw: Any) -> Any:
    async with httpx.AsyncClient(base_url=srv.http) as client:
        return await client.post(
            "/v1/realtime/client_secrets", json=body, headers=kw.get("headers", KEY_A)
        )


def with_secret(secret: str) -> list[str]:
    return [*SUBPROTOCOLS, f"vllm-realtime.auth.{secret}"]


async def test_a_secret_opens_a_session_as_its_key(secrets_server: RunningServer) -> None:
    srv = secrets_server
    minted = await mint(srv)
    assert minted.status_code == 200, minted.text
    body = minted.json()
    assert body["client_secret"].startswith("ek_") and body["expires_in_s"] == 30.0
    assert body["session"] is None and body["expires_at"] > 0
    async with websockets.connect(srv.url, subprotocols=with_secret(body["client_secret"])) as ws:
        assert ws.subprotocol == "vllm-realtime"  # the secret is never echoed
        await open_session(ws)
        # The session belongs to key-a (max_sessions_per_key=1): key-a has no room for another.
        async with websockets.connect(
            srv.url, subprotocols=[*SUBPROTOCOLS, "vllm-realtime.auth.key-a"]
        ) as other:
            await recv(other)
            await other.send(json.dumps({"type": "session.open"}))
            refused = await recv(other)
            assert refused["error"]["code"] == "capacity_exceeded", refused


async def test_a_secret_used_after_its_expiry_is_refused(secrets_server: RunningServer) -> None:
    srv = secrets_server
    secret = (await mint(srv, {"expires_in_s": 0.5})).json()["client_secret"]
    await asyncio.sleep(0.8)
    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
        async with websockets.connect(srv.url, subprotocols=with_secret(secret)):
            pass
    assert refused.value.response.status_code == 403
    # And a made-up one in the same shape.
    with pytest.raises(websockets.exceptions.InvalidStatus):
        async with websockets.connect(srv.url, subprotocols=with_secret("ek_" + "A" * 43)):
            pass


async def test_minting_needs_the_api_key_and_secrets_open_nothing_else(
    secrets_server: RunningServer,
) -> None:
    srv = secrets_server
    assert (await mint(srv, headers={})).status_code == 401
    secret = (await mint(srv)).json()["client_secret"]
    as_secret = {"Authorization": f"Bearer {secret}"}
    assert (await mint(srv, headers=as_secret)).status_code == 401  # no secret from a secret
    async with httpx.AsyncClient(base_url=srv.http) as client:
        assert (
            await client.post("/v1/streaming/sessions", json={}, headers=as_secret)
        ).status_code == 401
        assert (await client.get("/metrics", headers=as_secret)).status_code == 401
    # Lifetimes are capped by the server, and bad bodies are refused like events.
    capped = (await mint(srv, {"expires_in_s": 10_000})).json()
    assert capped["expires_in_s"] == 120.0
    bad = await mint(srv, {"expires_in_s": "10"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_event"


async def test_a_secret_bound_to_a_session_config_opens_exactly_that(
    secrets_server: RunningServer,
) -> None:
    srv = secrets_server
    bound = {
        "instructions": "Only this.",
        "sampling": {"max_tokens": 3},
        "retention": {"window_chunks": 2},
    }
    minted = (await mint(srv, {"session": bound})).json()
    assert minted["session"]["sampling"]["max_tokens"] == 3
    async with websockets.connect(srv.url, subprotocols=with_secret(minted["client_secret"])) as ws:
        opened = await open_session(ws, instructions="Something else", sampling={"max_tokens": 64})
        assert opened["config"]["instructions"] == "Only this."
        assert opened["config"]["sampling"]["max_tokens"] == 3
        assert opened["config"]["retention"]["window_chunks"] == 2
        await ws.send(json.dumps({"type": "session.close"}))
        assert (await drain_until_closed(ws))[-1]["type"] == "session.closed"
