"""Security: the API key on every route but the documented open ones, unguessable session ids,
callers confined to their own sessions, limits on frame size, frame rate and sessions per key."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import httpx
import pytest
import websockets
from fastapi.routing import APIRoute, APIWebSocketRoute
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from tests.realtime.conftest import RunningServer, jpeg_bytes
from tests.reliability.conftest import (
    SUBPROTOCOLS,
    drain_until_closed,
    open_session,
    recv,
    recv_until,
    wait_quiescent,
)

pytestmark = pytest.mark.slow

# docs/protocol.md, "Routes and the API key": the only routes open without a key.
OPEN_ROUTES = {"/health", "/"}
# FastAPI's schema and its Swagger UI page (docs/http.md): open, they hold no session or key.
SCHEMA_ROUTES = {"/openapi.json", "/docs", "/docs/oauth2-redirect"}
KEY_A = {"Authorization": "Bearer key-a"}
KEY_B = {"Authorization": "Bearer key-b"}


def _sample_path(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "sess_0123456789abcdef0123456789abcdef", path)


async def test_every_route_needs_the_key(two_key_server: RunningServer) -> None:
    app = two_key_server.app
    checked = 0
    async with httpx.AsyncClient(base_url=two_key_server.http, timeout=60) as client:
        for route in app.routes:  # type: ignore[attr-defined]
            if isinstance(route, APIWebSocketRoute):
                url = two_key_server.url.rsplit("/v1/", 1)[0] + route.path
                for offered, headers in (
                    (SUBPROTOCOLS, {}),
                    (SUBPROTOCOLS, {"Authorization": "Bearer wrong"}),
                    ([*SUBPROTOCOLS, "vllm-realtime.auth.wrong"], {}),
                ):
                    with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                        async with websockets.connect(
                            url, subprotocols=offered, additional_headers=headers
                        ):
                            pass
                    assert refused.value.response.status_code == 403
                # The documented query-string refusal: a key there is not a key.
                with pytest.raises(websockets.exceptions.InvalidStatus):
                    async with websockets.connect(
                        url + "?api_key=key-a", subprotocols=SUBPROTOCOLS
                    ):
                        pass
                for key in ("key-a", "key-b"):
                    offered = [*SUBPROTOCOLS, f"vllm-realtime.auth.{key}"]
                    async with websockets.connect(url, subprotocols=offered) as ws:
                        assert (await recv(ws))["type"] == "session.created"
                checked += 1
            elif isinstance(route, APIRoute):
                path = _sample_path(route.path)
                for method in sorted(route.methods - {"HEAD"}):
                    bare = await client.request(method, path)
                    keyed = await client.request(method, path, headers=KEY_B)
                    if route.path in OPEN_ROUTES:
                        assert bare.status_code == 200, (method, route.path)
                        continue
                    assert bare.status_code == 401, (method, route.path, bare.status_code)
                    assert bare.json()["error"]["code"] == "unauthorized"
                    wrong = await client.request(
                        method, path, headers={"Authorization": "Bearer x"}
                    )
                    assert wrong.status_code == 401
                    assert keyed.status_code != 401, (method, route.path)
                    is_json = keyed.headers.get("content-type", "").startswith("application/json")
                    opened = keyed.json() if keyed.status_code == 200 and is_json else {}
                    if isinstance(opened, dict) and opened.get("type") == "session.opened":
                        sid = opened["session_id"]
                        await client.delete(f"/v1/streaming/sessions/{sid}", headers=KEY_B)
                    checked += 1
            elif isinstance(route, Route) and route.path in SCHEMA_ROUTES:
                assert (await client.get(route.path)).status_code == 200, route.path
            elif isinstance(route, Mount):
                # Static files of the demo page (clients/): open like "/", and nothing else.
                assert isinstance(route.app, StaticFiles), route
            else:
                raise AssertionError(f"route {route!r} is not covered by this test")
        assert checked >= 5
        # The schema is served; ReDoc is not.
        assert (await client.get("/redoc")).status_code == 404


async def test_session_ids_have_at_least_128_random_bits(server: RunningServer) -> None:
    ids = {server.hub.new_protocol().session_id for _ in range(2000)}
    assert len(ids) == 2000
    for sid in ids:
        assert re.fullmatch(r"sess_[0-9a-f]{32}", sid), sid  # 32 hex = 128 bits
    # Every hex digit occurs in every position across the sample (no fixed or counter part).
    for pos in range(5, 37):
        assert len({sid[pos] for sid in ids}) == 16
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        assert re.fullmatch(r"sess_[0-9a-f]{32}", (await recv(ws))["session_id"])


async def test_a_connection_acts_only_on_its_own_session(two_key_server: RunningServer) -> None:
    srv = two_key_server
    offered = [*SUBPROTOCOLS, "vllm-realtime.auth.key-a"]
    async with (
        websockets.connect(srv.url, subprotocols=offered) as ws,
        httpx.AsyncClient(base_url=srv.http, timeout=60) as client,
    ):
        ws_sid = (await open_session(ws))["session_id"]
        # Client events name no session: a session_id field is refused, not honoured.
        for kind in ("session.close", "response.cancel", "frame.append"):
            await ws.send(json.dumps({"type": kind, "session_id": "sess_x", "text": "x"}))
            err = await recv(ws)
            assert err["error"]["code"] == "invalid_event", err
        # A WebSocket session is not reachable through the HTTP adapter, even by its owner.
        r = await client.post(f"/v1/streaming/sessions/{ws_sid}/frame", headers=KEY_A, content=b"x")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        r = await client.delete(f"/v1/streaming/sessions/{ws_sid}", headers=KEY_A)
        assert r.status_code == 404
        # An HTTP session of key-a: key-b gets exactly what a missing id gets.
        r = await client.post("/v1/streaming/sessions", headers=KEY_A, json={})
        assert r.status_code == 200, r.text
        http_sid = r.json()["session_id"]
        for headers in (KEY_B,):
            frame = await client.post(
                f"/v1/streaming/sessions/{http_sid}/frame",
                headers={**headers, "content-type": "image/jpeg"},
                content=jpeg_bytes(1),
            )
            missing = await client.post(
                "/v1/streaming/sessions/sess_doesnotexist/frame",
                headers={**headers, "content-type": "image/jpeg"},
                content=jpeg_bytes(1),
            )
            assert frame.status_code == missing.status_code == 404
            assert frame.json()["error"] | {"message": ""} == missing.json()["error"] | {
                "message": ""
            }
            assert (
                await client.delete(f"/v1/streaming/sessions/{http_sid}", headers=headers)
            ).status_code == 404
        # The owner still can.
        ok = await client.post(
            f"/v1/streaming/sessions/{http_sid}/frame",
            headers={**KEY_A, "content-type": "image/jpeg"},
            content=jpeg_bytes(2),
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["frame_index"] == 0
        r = await client.delete(f"/v1/streaming/sessions/{http_sid}", headers=KEY_A)
        assert r.status_code == 200
        await ws.send(json.dumps({"type": "session.close"}))
        await drain_until_closed(ws)
    await wait_quiescent(srv)


async def test_frame_size_limits(server: RunningServer) -> None:
    limit = server.hub.config.max_frame_bytes  # 1 MiB here
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS, max_size=None) as ws:
        await open_session(ws)
        await ws.send(json.dumps({"type": "frame.append", "binary": True, "event_id": "big"}))
        await ws.send(b"\xff\xd8\xff" + b"\x00" * limit)
        err = await recv(ws)
        assert err["error"]["code"] == "frame_too_large" and err["error"]["event_id"] == "big"
        assert err["error"]["session_survives"]
        await ws.send(json.dumps({"type": "frame.append", "binary": True}))
        await ws.send(jpeg_bytes(1))
        done, _ = await recv_until(ws, "response.done")
        assert done["status"] in ("completed", "incomplete")
    async with httpx.AsyncClient(base_url=server.http, timeout=60) as client:
        sid = (await client.post("/v1/streaming/sessions", json={})).json()["session_id"]
        url = f"/v1/streaming/sessions/{sid}/frame"
        r = await client.post(url, content=b"\xff\xd8\xff" + b"\x00" * limit)
        assert r.status_code == 413 and r.json()["error"]["code"] == "frame_too_large"

        async def endless() -> AsyncIterator[bytes]:
            # Chunked, no Content-Length: the server must stop reading at the limit (bounded
            # here at 64 MiB so that a server that reads everything still ends the test).
            yield b"\xff\xd8\xff"
            for _ in range(64):
                yield b"\x00" * (1 << 20)

        try:
            r = await client.post(url, content=endless())
            assert r.status_code == 413
        except httpx.HTTPError:
            pass  # the server answered 413 and closed while the body was still going
        r = await client.post(url, content=jpeg_bytes(3), headers={"content-type": "image/jpeg"})
        assert r.status_code == 200, r.text
        assert (await client.delete(f"/v1/streaming/sessions/{sid}")).status_code == 200
    await wait_quiescent(server)


async def test_a_message_over_the_transport_limit_closes_with_1009(server: RunningServer) -> None:
    """uvicorn's WebSocket limit (16 MiB by default, `limits.max_event_bytes` + 1 MiB in
    `vllm-realtime serve`) closes the socket with 1009, as documented; the server stays up."""
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS, max_size=None) as ws:
        await open_session(ws)
        await ws.send(json.dumps({"type": "frame.append", "text": "x" * (17 << 20)}))
        seen = await drain_until_closed(ws)
        assert all(e["type"] != "error" or e["error"]["code"] == "frame_too_large" for e in seen)
        assert ws.close_code in (1009, 1000), ws.close_code
    async with httpx.AsyncClient(base_url=server.http) as client:
        assert (await client.get("/health")).status_code == 200
    await wait_quiescent(server)


async def test_frame_rate_limit(rate_server: RunningServer) -> None:
    """max_frames_per_s=2, frame_burst=3: the fourth frame in a burst is rate_limited."""
    bad = json.dumps({"type": "frame.append", "image": "bm90IGFuIGltYWdl", "event_id": "f"})
    async with websockets.connect(rate_server.url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(ws)
        codes = []
        for _ in range(5):
            await ws.send(bad)
            codes.append((await recv(ws))["error"]["code"])
        assert codes[:3] == ["undecodable_frame"] * 3
        assert codes[3:] == ["rate_limited"] * 2
        await asyncio.sleep(0.6)  # one token back
        await ws.send(json.dumps({"type": "frame.append", "binary": True}))
        await ws.send(jpeg_bytes(2))
        done, seen = await recv_until(ws, "response.done")
        assert done["status"] in ("completed", "incomplete"), seen
        # Other events are not frames: never rate-limited.
        for _ in range(6):
            await ws.send(json.dumps({"type": "response.cancel"}))
            assert (await recv(ws))["error"]["code"] == "no_response_in_flight"
        # The bucket refilled while the turn ran (up to the burst on a loaded machine): the
        # frame after the burst is limited again.
        for _ in range(4):
            await ws.send(bad)
            err = await recv(ws)
            if err["error"]["code"] == "rate_limited":
                break
        assert err["error"]["code"] == "rate_limited" and err["error"]["session_survives"]
        assert err["error"]["type"] == "capacity_error" and err["error"]["event_id"] == "f"
    await wait_quiescent(rate_server)


async def test_sessions_per_api_key(two_key_server: RunningServer) -> None:
    srv = two_key_server  # max_sessions_per_key=2, max_sessions=6
    url = srv.url

    def key(k: str) -> list[str]:
        return [*SUBPROTOCOLS, f"vllm-realtime.auth.{k}"]

    sockets = []
    try:
        for _ in range(2):
            ws = await websockets.connect(url, subprotocols=key("key-a"))
            sockets.append(ws)
            await open_session(ws)
        extra = await websockets.connect(url, subprotocols=key("key-a"))
        sockets.append(extra)
        await recv(extra)
        await extra.send(json.dumps({"type": "session.open", "event_id": "third"}))
        err = await recv(extra)
        assert err["error"]["code"] == "capacity_exceeded" and err["error"]["session_survives"]
        assert "per key" in err["error"]["message"]
        # HTTP sessions of the key count too.
        async with httpx.AsyncClient(base_url=srv.http, timeout=60) as client:
            r = await client.post("/v1/streaming/sessions", headers=KEY_A, json={})
            assert r.status_code == 429 and r.json()["error"]["code"] == "capacity_exceeded"
            r = await client.post("/v1/streaming/sessions", headers=KEY_B, json={})
            assert r.status_code == 200
            assert (
                await client.delete(
                    f"/v1/streaming/sessions/{r.json()['session_id']}", headers=KEY_B
                )
            ).status_code == 200
        # Another key is not affected, and the refused connection may retry once one closes.
        other = await websockets.connect(url, subprotocols=key("key-b"))
        sockets.append(other)
        await open_session(other)
        await sockets[0].send(json.dumps({"type": "session.close"}))
        await drain_until_closed(sockets[0])
        for _ in range(100):
            if sum(1 for r in srv.hub.sessions.values() if r.owner == "key-a") < 2:
                break
            await asyncio.sleep(0.05)
        await extra.send(json.dumps({"type": "session.open", "event_id": "retry"}))
        assert (await recv(extra))["type"] == "session.opened"
    finally:
        for ws in sockets:
            await ws.close()
    await wait_quiescent(srv)


def test_sessions_ids_and_image_payloads_stay_out_of_redacted_paths() -> None:
    from realtime.server import _redact_path

    sid = "sess_" + "ab" * 16
    assert _redact_path(f"/v1/streaming/sessions/{sid}/frame?prompt=secret") == (
        "/v1/streaming/sessions/sess_abababa…/frame"
    )
    assert _redact_path("/v1/realtime?api_key=k") == "/v1/realtime"
