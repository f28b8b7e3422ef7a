"""End to end: real WebSocket clients → real uvicorn server → real vLLM engine (tiny VLM)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
from typing import Any

import httpx
import pytest
import websockets

from retention.vllm_adapter.introspect import kv_stats
from tests.realtime.conftest import (
    BOUNDED_TEXT,
    SUBPROTOCOLS,
    RunningServer,
    image_event,
    jpeg_bytes,
    open_session,
    recv,
    recv_until,
)
from vllm_realtime_protocol import SessionConfig

pytestmark = pytest.mark.slow


async def free_blocks(server: RunningServer) -> int:
    return int((await kv_stats(server.hub.engine))["num_free_blocks"])


async def wait_free_blocks(server: RunningServer, want: int) -> int:
    got = -1
    for _ in range(200):
        got = await free_blocks(server)
        if got == want and not server.hub.sessions:
            return got
        await asyncio.sleep(0.05)
    return got


async def quiescent_free_blocks(server: RunningServer) -> int:
    """The pool once earlier tests' server-side clean-up has run: every usable block free."""
    usable = int((await kv_stats(server.hub.engine))["num_usable_blocks"])
    assert await wait_free_blocks(server, usable) == usable
    return usable


async def test_health_and_greeting(server: RunningServer) -> None:
    async with httpx.AsyncClient() as client:
        r = await client.get(server.http + "/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        assert ws.subprotocol == "vllm-realtime"
        hello = await recv(ws)
        assert hello["type"] == "session.created"
        assert len(hello["session_id"]) >= 22 and hello["event_id"]


async def test_lifecycle_frames_replies_and_clean_close(server: RunningServer) -> None:
    before = await quiescent_free_blocks(server)
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(ws, instructions="Describe each frame.")
        for i in range(3):
            await ws.send(image_event(i, frame_id=f"f{i}", prompt="what is this?"))
            done, seen = await recv_until(ws, "response.done")
            kinds = [e["type"] for e in seen]
            assert kinds[0] == "input.ack" and "response.created" in kinds
            assert done["frame_index"] == i and done["frame_id"] == f"f{i}"
            assert done["status"] in ("completed", "incomplete")
            assert done["usage"]["completion_tokens"] >= 1
            # 16 image tokens + chat scaffolding per frame.
            assert done["usage"]["prompt_tokens"] > 16
            deltas = "".join(e["delta"] for e in seen if e["type"] == "response.text.delta")
            assert deltas == done["text"]
            assert done["retention"]["kv_blocks_held"] >= 1
        await ws.send(json.dumps({"type": "session.close"}))
        closed, _ = await recv_until(ws, "session.closed")
        assert closed["reason"] == "client_closed" and closed["frames_total"] == 3
    # Every block the session held is back in the pool.
    assert await wait_free_blocks(server, before) == before


async def test_binary_frame_flow(server: RunningServer) -> None:
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(ws)
        await ws.send(json.dumps({"type": "frame.append", "binary": True, "frame_id": "bin"}))
        await ws.send(jpeg_bytes(7))
        done, _ = await recv_until(ws, "response.done")
        assert done["frame_id"] == "bin" and done["status"] in ("completed", "incomplete")


async def test_in_flight_rejection_is_documented_and_recoverable(server: RunningServer) -> None:
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(ws)
        await ws.send(image_event(1))
        await ws.send(image_event(2, event_id="second"))
        done, seen = await recv_until(ws, "response.done")
        errors = [e for e in seen if e["type"] == "error"]
        assert [e["error"]["code"] for e in errors] == ["chunk_in_flight"]
        assert errors[0]["error"]["event_id"] == "second" and errors[0]["error"]["session_survives"]
        assert done["frame_index"] == 0
        # The refused frame was not queued: the next one is index 1.
        await ws.send(image_event(3))
        done, _ = await recv_until(ws, "response.done")
        assert done["frame_index"] == 1


@pytest.mark.parametrize(
    ("message", "code", "param"),
    [
        ("{not json", "invalid_json", None),
        (json.dumps({"type": "frame.teleport"}), "unknown_event_type", "type"),
        (json.dumps({"type": "frame.append", "image": 42}), "invalid_event", "image"),
        (
            json.dumps({"type": "frame.append", "image": "aGVsbG8=", "bogus": 1}),
            "invalid_event",
            "bogus",
        ),
        (
            json.dumps(
                {"type": "frame.append", "image": base64.b64encode(b"\xff\xd8\xffjunk").decode()}
            ),
            "undecodable_frame",
            None,  # sniffed as JPEG, acked; the decoder refuses it later, as the chunk
        ),
        (
            json.dumps({"type": "frame.append", "image": base64.b64encode(b"GIF89a").decode()}),
            "undecodable_frame",
            "image",
        ),
        (
            json.dumps(
                {"type": "frame.append", "image": base64.b64encode(b"x" * (2 << 20)).decode()}
            ),
            "frame_too_large",
            "image",
        ),
        (json.dumps({"type": "response.cancel"}), "no_response_in_flight", None),
    ],
)
async def test_bad_input_gets_documented_error_and_connection_lives(
    server: RunningServer, message: str, code: str, param: str | None
) -> None:
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS, max_size=None) as ws:
        await open_session(ws)
        await ws.send(message)
        err, seen = await recv_until(ws, "error")
        assert err["error"]["code"] == code, err
        assert err["error"]["param"] == param, err  # the offending field, by its wire path
        # A payload that passes the cheap checks is accepted (acked) and fails at decode: its
        # response.done says so before the error.
        dones = [e for e in seen if e["type"] == "response.done"]
        assert all(d["status"] == "failed" and d["status_reason"] == code for d in dones)
        if err["error"]["session_survives"]:
            await ws.send(image_event(5))
            done, _ = await recv_until(ws, "response.done")
            assert done["status"] in ("completed", "incomplete")
            assert done["frame_index"] == len(dones)


async def test_disconnect_mid_frame_frees_every_block(server: RunningServer) -> None:
    before = await quiescent_free_blocks(server)
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(ws, sampling={"max_tokens": 64})
        await ws.send(image_event(9))
        await recv_until(ws, "input.ack")
    assert await wait_free_blocks(server, before) == before
    assert not server.hub.sessions


async def test_concurrent_sessions_get_their_own_replies(server: RunningServer) -> None:
    before = await quiescent_free_blocks(server)

    async def one(n: int) -> list[int]:
        async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
            await open_session(ws)
            got = []
            for i in range(3):
                await ws.send(image_event(n * 10 + i, frame_id=f"s{n}-{i}"))
                done, _ = await recv_until(ws, "response.done")
                assert done["frame_id"] == f"s{n}-{i}"
                got.append(done["frame_index"])
            return got

    results = await asyncio.gather(*(one(n) for n in range(4)))
    assert results == [[0, 1, 2]] * 4
    assert await wait_free_blocks(server, before) == before


async def test_http_adapter_round_trip(server: RunningServer) -> None:
    before = await quiescent_free_blocks(server)
    async with httpx.AsyncClient(base_url=server.http, timeout=60) as client:
        r = await client.post("/v1/streaming/sessions", json={"sampling": {"max_tokens": 3}})
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        prefilled = []
        for i, params in enumerate(({}, {"prompt": "What colour is the circle?"})):
            r = await client.post(
                f"/v1/streaming/sessions/{sid}/frame",
                content=jpeg_bytes(0),
                headers={"content-type": "image/jpeg"},
                params=params,
            )
            assert r.status_code == 200, r.text
            assert r.json()["type"] == "response.done" and r.json()["frame_index"] == i
            prefilled.append(r.json()["usage"]["prompt_tokens"])
        # The same image twice: `?prompt=` (docs/http.md) adds its tokens to the second chunk.
        assert prefilled[1] > prefilled[0], prefilled
        r = await client.post("/v1/streaming/sessions/nope/frame", content=b"x")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        r = await client.delete(f"/v1/streaming/sessions/{sid}")
        assert r.status_code == 200
    assert await wait_free_blocks(server, before) == before


async def test_api_key_enforced(keyed_server: RunningServer) -> None:
    with pytest.raises(websockets.exceptions.InvalidStatus):
        async with websockets.connect(keyed_server.url, subprotocols=SUBPROTOCOLS):
            pass
    offered = ["vllm-realtime", "vllm-realtime.auth.sekret-key"]
    async with websockets.connect(keyed_server.url, subprotocols=offered) as ws:
        assert ws.subprotocol == "vllm-realtime"  # the key is never echoed
        assert (await recv(ws))["type"] == "session.created"
    headers = {"Authorization": "Bearer sekret-key"}
    async with websockets.connect(
        keyed_server.url, subprotocols=SUBPROTOCOLS, additional_headers=headers
    ) as ws:
        assert (await recv(ws))["type"] == "session.created"
    async with httpx.AsyncClient(base_url=keyed_server.http) as client:
        assert (await client.post("/v1/streaming/sessions", json={})).status_code == 401
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers=headers)).status_code == 200


async def _fill_until_refused(
    server: RunningServer, admitted: int
) -> tuple[list[Any], dict[str, Any]]:
    sockets = []
    for _ in range(admitted):
        ws = await websockets.connect(server.url, subprotocols=SUBPROTOCOLS)
        sockets.append(ws)
        await open_session(ws)
    extra = await websockets.connect(server.url, subprotocols=SUBPROTOCOLS)
    sockets.append(extra)
    await recv(extra)
    await extra.send(json.dumps({"type": "session.open", "event_id": "x"}))
    return sockets, await recv(extra)


async def test_session_count_limit_refused_at_open(server: RunningServer) -> None:
    hub = server.hub
    # This server's max_sessions (8) binds before its KV pool does.
    assert hub.usable_blocks // hub.reservation_blocks(None) > hub.config.max_sessions
    sockets, err = await _fill_until_refused(server, hub.config.max_sessions)
    try:
        assert err["type"] == "error" and err["error"]["code"] == "capacity_exceeded"
        assert "at most" in err["error"]["message"]
        # The admitted ones keep answering.
        await sockets[0].send(image_event(1))
        done, _ = await recv_until(sockets[0], "response.done")
        assert done["status"] in ("completed", "incomplete")
    finally:
        for ws in sockets:
            await ws.close()


async def test_kv_admission_refuses_what_the_pool_cannot_hold(vlm_engine: Any) -> None:
    from tests.realtime.conftest import _serve

    # No session-count limit in the way: only the KV reservation can refuse.
    async for big in _serve(vlm_engine, None, max_sessions=10_000):
        hub = big.hub
        # The max_num_seqs slot cap refuses first on this engine; it has its own test
        # (tests/reliability/test_capacity.py). Here only the KV rule may refuse.
        hub._admission = dataclasses.replace(hub.admission, engine_slots=None)
        fits = hub.usable_blocks // hub.reservation_blocks(None)
        sockets, err = await _fill_until_refused(big, fits)
        try:
            assert err["type"] == "error" and err["error"]["code"] == "capacity_exceeded"
            assert "KV cache" in err["error"]["message"]
            assert len(hub.sessions) == fits
            await sockets[0].send(image_event(1))
            done, _ = await recv_until(sockets[0], "response.done")
            assert done["status"] in ("completed", "incomplete")
        finally:
            for ws in sockets:
                await ws.close()


async def test_metrics_exposed(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.http) as client:
        body = (await client.get("/metrics")).text
    for name in (
        "vllm_realtime_sessions_open",
        "vllm_realtime_frame_latency_seconds",
        "vllm_realtime_kv_blocks_held",
    ):
        assert name in body


async def test_text_session_is_bounded_by_in_place_eviction(text_server: RunningServer) -> None:
    """SmolLM2 text turns through the server: the window slides, KV blocks stay bounded."""
    before = await quiescent_free_blocks(text_server)
    async with websockets.connect(text_server.url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(
            ws,
            instructions="Answer in one word.",
            **BOUNDED_TEXT,
        )
        held = []
        for i in range(12):
            await ws.send(json.dumps({"type": "frame.append", "text": f"Turn {i}: name a color."}))
            done, _ = await recv_until(ws, "response.done")
            assert done["status"] in ("completed", "incomplete"), done
            held.append(done["retention"]["kv_blocks_held"])
        assert done["retention"]["frames_evicted"] >= 4
        assert done["retention"]["frames_retained"] <= 4
        # Bounded: sink turn (~40 tokens) + 2 window turns + the turn in flight (~22 tokens
        # each) + at most one block of remnants ≈ 140 tokens ≤ 5 blocks of 32. Unbounded, 12
        # turns would hold ≥ 9 blocks.
        assert max(held) <= 5, held
    assert await wait_free_blocks(text_server, before) == before


async def test_bounded_text_session_outlives_max_model_len(text_server: RunningServer) -> None:
    """A bounded session is checked against the tokens it holds, not the tokens ever sent.

    The hub's context guard once summed every chunk of the session, so a bounded session on a
    1024-token engine was refused with `context_exceeded` after ~1,000 tokens in all, although
    the engine held ~200 (found by `bench.soak`).
    """
    before = await quiescent_free_blocks(text_server)
    sentence = "The meter on the north wall shows a steady reading, and the operator notes it down."
    async with websockets.connect(text_server.url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(
            ws,
            instructions="Answer in one word.",
            **BOUNDED_TEXT,
        )
        sent = 0
        for i in range(40):
            await ws.send(json.dumps({"type": "frame.append", "text": f"{i}. {sentence}"}))
            done, _ = await recv_until(ws, "response.done")
            assert done["status"] in ("completed", "incomplete"), (i, done)
            sent += done["usage"]["prompt_tokens"] + done["usage"]["completion_tokens"]
            r = done["retention"]
            # tokens_retained counts the chunk just answered too: it is in the cache.
            assert r["tokens_retained"] <= r["kv_blocks_held"] * 32, r
            assert r["tokens_retained"] > (r["kv_blocks_held"] - 2) * 32, r
        assert sent > 1024 + 256, sent  # well past max_model_len in all
        assert r["tokens_retained"] < 300, r
    assert await wait_free_blocks(text_server, before) == before


async def test_budget_that_cannot_fit_is_refused_with_its_numbers(vlm_engine: Any) -> None:
    """Defect 3 of the capacity issue: sinks + window + chunk + reply past the positions. A
    strict server refuses it with the numbers; the default server reserves it as a whole
    context. A budget that fits reserves its footprint, reported in session.opened."""
    from tests.realtime.conftest import _serve

    too_big = {"sink_chunks": 1, "window_chunks": 40}
    for strict in (True, False):
        async for srv in _serve(vlm_engine, None, strict_budgets=strict):
            async with websockets.connect(srv.url, subprotocols=SUBPROTOCOLS) as ws:
                assert (await recv(ws))["type"] == "session.created"
                await ws.send(
                    json.dumps({"type": "session.open", "modality": "text", "retention": too_big})
                )
                reply = await recv(ws)
                if strict:
                    assert reply["type"] == "error", reply
                    assert reply["error"]["code"] == "invalid_request"
                    message = reply["error"]["message"]
                    assert "window" in message and "max_position=4096" in message, message
                    await ws.send(json.dumps({"type": "session.open", **BOUNDED_TEXT}))
                    opened = await recv(ws)
                    assert opened["type"] == "session.opened", opened
                    reservation = opened["reservation"]
                    assert reservation["bounded"] and reservation["block_size"] == 32
                    assert reservation["kv_blocks"] == srv.hub.reservation_blocks(
                        SessionConfig(**BOUNDED_TEXT)
                    )
                    assert reservation["kv_blocks"] < srv.hub.reservation_blocks(
                        SessionConfig(modality="text", retention={"enabled": False})
                    )
                else:
                    assert reply["type"] == "session.opened", reply
                    assert reply["reservation"]["bounded"] is False


async def test_session_limits_shrink_the_reservation_and_are_enforced(
    server: RunningServer,
) -> None:
    """A session that caps its own chunks (session.open.limits) reserves less KV, and a chunk
    over its caps is refused with chunk_too_large (the session goes on)."""
    from tests.reliability.fuzzcore import _clip

    hub = server.hub
    small = {"max_chunk_tokens": 32, "max_clip_frames": 2}
    config = {
        "retention": {"sink_chunks": 1, "window_chunks": 4},
        "sampling": {"max_tokens": 4},
    }
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        created = await recv(ws)
        assert created["limits"]["max_clip_frames"] == 16
        await ws.send(
            json.dumps({"type": "session.open", **config, "limits": {"max_chunk_tokens": 10**6}})
        )
        err = await recv(ws)
        assert err["type"] == "error" and err["error"]["code"] == "invalid_request", err
        assert "limits.max_chunk_tokens" in err["error"]["message"]
        await ws.send(json.dumps({"type": "session.open", **config, "limits": small}))
        opened = await recv(ws)
        assert opened["type"] == "session.opened", opened
        assert opened["config"]["limits"] == {
            **small,
            "max_frame_pixels": None,
            "frames_per_s": 1.0,
        }
        default = hub.reservation_blocks(SessionConfig(**config))
        assert opened["reservation"]["bounded"]
        assert opened["reservation"]["kv_blocks"] < default
        await ws.send(image_event(1, prompt="What is here?"))
        done, _ = await recv_until(ws, "response.done")
        assert done["status"] in ("completed", "incomplete"), done
        await ws.send(image_event(2, prompt=" ".join(["describe the light"] * 12)))
        err, _ = await recv_until(ws, "error")
        assert err["error"]["code"] == "chunk_too_large", err
        assert "max_chunk_tokens" in err["error"]["message"]
        clip = base64.b64encode(_clip("mp4", "mpeg4", frames=6, size=64)).decode()
        await ws.send(json.dumps({"type": "frame.append", "video": clip}))
        err, _ = await recv_until(ws, "error")
        assert err["error"]["code"] == "chunk_too_large", err
        assert "max_clip_frames" in err["error"]["message"]
        await ws.send(image_event(3))
        done, _ = await recv_until(ws, "response.done")
        assert done["status"] in ("completed", "incomplete"), done
