"""Tests on a DEDICATED tiny-VLM engine + server (the shared engines are never harmed):
load (32 concurrent sessions), capacity until refusal, payloads absent from every log, and,
last, the engine process killed under open sessions.

The engine has 48 request slots (the shared one has 16), a 4096-token context and a 180 MiB KV
pool, so KV is what refuses the 45th session here. Its EngineCore's stdout/stderr go to a file for the log test.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import psutil
import pytest
import websockets

from tests.conftest import engine_settings
from tests.realtime.conftest import RunningServer, _serve, jpeg_bytes
from tests.reliability.conftest import (
    SUBPROTOCOLS,
    capture_logs,
    drain_until_closed,
    open_session,
    recv,
    recv_until,
    wait_quiescent,
)
from vllm_realtime_protocol import SessionConfig

pytestmark = pytest.mark.slow

LOAD_SESSIONS = 32
# 32×100 takes about a minute on 2 idle cores; lower it with the variable on a busy machine
# (`bench/soak.py load` runs the same load outside pytest).
LOAD_FRAMES = int(os.environ.get("VLLM_REALTIME_LOAD_FRAMES", "100"))
MAX_MODEL_LEN = 4096  # the tiny VLM's max_position_embeddings


@dataclass
class Own:
    server: RunningServer
    engine: Any
    output: Path  # what the EngineCore and its worker printed
    processes: list[psutil.Process]


@contextlib.contextmanager
def _child_stdio_to(out: IO[bytes]) -> Iterator[None]:
    """Processes started inside inherit `out` as stdout/stderr; this process keeps its own."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


@pytest.fixture(scope="module")
async def own(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Own]:
    from realtime.engine import start_engine

    output = tmp_path_factory.mktemp("own-engine") / "engine-output.log"
    settings = engine_settings(
        "tiny-qwen2-vl",
        # 100 frames of ~35 tokens need more than the shared engines' 1024. 180 MiB of KV keep
        # KV the binding limit (44 clip-declaring sessions of 129 blocks) below the 48 request
        # slots.
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=180 << 20,
        max_num_seqs=48,
        extra={"limit_mm_per_prompt": {"image": 1, "video": 1}},
    )
    with open(output, "wb") as out, _child_stdio_to(out):
        engine = start_engine(settings)
    manager = engine.engine_core.resources.engine_manager
    cores = [psutil.Process(p.pid) for p in manager.processes]
    processes = cores + [c for p in cores for c in p.children(recursive=True)]
    try:
        async for srv in _serve(
            engine, None, max_sessions=64, idle_timeout_s=120.0, max_frame_bytes=1 << 20
        ):
            yield Own(srv, engine, output, processes)
    finally:
        with contextlib.suppress(Exception):
            engine.shutdown()
        # Only the processes this fixture started (by pid), e.g. a worker orphaned by the kill.
        for proc in processes:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def frame_event(seed: int, frame_id: str) -> str:
    image = base64.b64encode(jpeg_bytes(seed)).decode()
    return json.dumps({"type": "frame.append", "image": image, "frame_id": frame_id})


async def test_load_32_sessions_get_only_their_own_replies(own: Own) -> None:
    srv = own.server
    before = await wait_quiescent(srv)
    latencies: list[float] = []
    images = [jpeg_bytes(i) for i in range(8)]

    async def one(n: int) -> str:
        token = f"conn{n:02d}"
        async with websockets.connect(srv.url, subprotocols=SUBPROTOCOLS) as ws:
            sid = (await open_session(ws, sampling={"max_tokens": 4}))["session_id"]
            for i in range(LOAD_FRAMES):
                frame_id = f"{token}-{i}"
                started = time.perf_counter()
                if i % 2:
                    await ws.send(
                        json.dumps({"type": "frame.append", "binary": True, "frame_id": frame_id})
                    )
                    await ws.send(images[(n + i) % 8])
                else:
                    await ws.send(frame_event((n + i) % 8, frame_id))
                done, seen = await recv_until(ws, "response.done", timeout=300)
                latencies.append(time.perf_counter() - started)
                for ev in seen:
                    assert ev["type"] != "error", ev
                    if "frame_index" in ev:
                        assert ev["frame_index"] == i, ev
                    if ev["type"] in ("input.ack", "response.created", "response.done"):
                        assert ev["frame_id"] == frame_id, (ev, frame_id)
                assert done["status"] in ("completed", "incomplete"), done
                text = "".join(e["delta"] for e in seen if e["type"] == "response.text.delta")
                assert text == done["text"]
            await ws.send(json.dumps({"type": "session.close"}))
            closed = await drain_until_closed(ws)
            assert closed[-1]["type"] == "session.closed" and closed[-1]["session_id"] == sid
            assert closed[-1]["frames_total"] == LOAD_FRAMES
            return str(sid)

    with capture_logs(level=logging.WARNING) as logs:
        started = time.perf_counter()
        sids = await asyncio.gather(*(one(n) for n in range(LOAD_SESSIONS)))
        elapsed = time.perf_counter() - started
    assert len(set(sids)) == LOAD_SESSIONS
    assert await wait_quiescent(srv) == before  # zero blocks leaked
    assert not logs.failures(), logs.text()
    q = statistics.quantiles(latencies, n=100)
    print(
        f"\nload {LOAD_SESSIONS}x{LOAD_FRAMES}: {elapsed:.1f}s, "
        f"{len(latencies) / elapsed:.1f} frames/s, p50 {q[49] * 1e3:.0f} ms, p99 {q[98] * 1e3:.0f} ms"
    )


async def test_capacity_until_refused_and_no_deadlock(own: Own) -> None:
    srv = own.server
    hub = srv.hub
    before = await wait_quiescent(srv)
    # Sessions that declare 16-frame clips are reserved a whole context each (129 blocks): KV,
    # not the session or request-slot counts, binds (undeclared ones now reserve single images).
    clips = {"limits": {"max_clip_frames": 16}, "sampling": {"max_tokens": 4}}
    fits = hub.usable_blocks // hub.reservation_blocks(SessionConfig.model_validate(clips))
    assert fits < min(hub.config.max_sessions, hub.engine_slots or 10**9), "KV must bind here"
    sockets: list[Any] = []
    try:
        refused = None
        for _n in range(hub.config.max_sessions + 1):
            ws = await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS)
            sockets.append(ws)
            await recv(ws)
            await ws.send(json.dumps({"type": "session.open", **clips}))
            reply = await recv(ws)
            if reply["type"] == "error":
                refused = reply
                break
            assert reply["type"] == "session.opened"
        assert refused is not None and refused["error"]["code"] == "capacity_exceeded"
        assert refused["error"]["session_survives"]
        assert "KV cache" in refused["error"]["message"]
        admitted = sockets[:-1]
        assert len(admitted) == fits == len(hub.sessions)

        async def frame(ws: Any, i: int, tag: str) -> None:
            await ws.send(frame_event(i % 8, f"{tag}-{i}"))
            done, _ = await recv_until(ws, "response.done", timeout=300)
            assert done["frame_id"] == f"{tag}-{i}" and done["status"] != "failed", done

        # Every admitted session answers, twice: the second round runs while all the others
        # are paused holding their slots (the starvation admission must rule out).
        for tag in ("first", "second"):
            await asyncio.wait_for(
                asyncio.gather(*(frame(ws, i, tag) for i, ws in enumerate(admitted))), 600
            )
        # The refused connection is still usable and gets in once a session closes.
        await admitted[0].send(json.dumps({"type": "session.close"}))
        await drain_until_closed(admitted[0])
        for _ in range(200):
            if len(hub.sessions) < fits:
                break
            await asyncio.sleep(0.05)
        await sockets[-1].send(json.dumps({"type": "session.open", "sampling": {"max_tokens": 4}}))
        assert (await recv(sockets[-1]))["type"] == "session.opened"
        await frame(sockets[-1], 0, "late")
    finally:
        for ws in sockets:
            await ws.close()
    assert await wait_quiescent(srv) == before


SECRETS = {
    "instructions": "SECRET-INSTRUCTIONS-7f3a",
    "prompt": "SECRET-PROMPT-9c1e",
    "text": "SECRET-TEXT-TURN-4d2b",
    "query_prompt": "SECRET-QUERY-PROMPT-1a8f",
}


async def test_logs_hold_no_frames_prompts_or_session_ids(own: Own) -> None:
    srv = own.server
    image = jpeg_bytes(42)
    b64 = base64.b64encode(image).decode()
    output_before = own.output.stat().st_size
    names = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "vllm_realtime", "asyncio", "vllm")
    with capture_logs(names, level=logging.INFO) as logs:
        sids = []
        async with websockets.connect(srv.url, subprotocols=SUBPROTOCOLS) as ws:
            opened = await open_session(ws, instructions=SECRETS["instructions"])
            sids.append(opened["session_id"])
            await ws.send(
                json.dumps({"type": "frame.append", "image": b64, "prompt": SECRETS["prompt"]})
            )
            await recv_until(ws, "response.done")
            await ws.send(json.dumps({"type": "frame.append", "image": "bm90IGFuIGltYWdl"}))
            await recv_until(ws, "error")
        async with websockets.connect(srv.url, subprotocols=SUBPROTOCOLS) as ws:
            opened = await open_session(ws, modality="text")
            sids.append(opened["session_id"])
            await ws.send(json.dumps({"type": "frame.append", "text": SECRETS["text"]}))
            await recv_until(ws, "response.done")
        async with httpx.AsyncClient(base_url=srv.http, timeout=60) as client:
            sid = (await client.post("/v1/streaming/sessions", json={})).json()["session_id"]
            sids.append(sid)
            r = await client.post(
                f"/v1/streaming/sessions/{sid}/frame",
                params={"prompt": SECRETS["query_prompt"]},
                content=image,
                headers={"content-type": "image/jpeg"},
            )
            assert r.status_code == 200, r.text
            await client.delete(f"/v1/streaming/sessions/{sid}")
        await wait_quiescent(srv)
    ours = logs.text()
    with open(own.output, "rb") as f:
        f.seek(output_before)
        engine_out = f.read().decode("utf-8", "replace")
    assert "session opened" in ours  # the capture saw the server's own log lines
    assert re.search(r"POST /v1/streaming/sessions/sess_[0-9a-f]{7}…/frame", ours), ours[-2000:]
    for where, text in (("server logs", ours), ("engine output", engine_out)):
        for name, secret in SECRETS.items():
            assert secret not in text, f"{name} in {where}"
        assert b64[100:160] not in text, f"frame payload in {where}"
        for sid in sids:
            assert sid not in text, f"full session id in {where}"


async def test_engine_death_closes_every_session(own: Own) -> None:
    """Last in this module: kills the dedicated EngineCore. The server does not restart the
    engine: /health turns 503 (for a supervisor or orchestrator to restart the server), open
    sessions get `error` engine_error + `session.closed`, new sessions are refused."""
    srv = own.server
    async with httpx.AsyncClient(base_url=srv.http, timeout=60) as client:
        assert (await client.get("/health")).status_code == 200
        http_sid = (await client.post("/v1/streaming/sessions", json={})).json()["session_id"]
        idle = []
        for _ in range(2):
            ws = await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS)
            await open_session(ws)
            idle.append(ws)
        busy = await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS)
        await open_session(busy, sampling={"max_tokens": 512})
        await busy.send(frame_event(1, "busy"))
        await recv_until(busy, "response.text.delta")

        core = own.processes[0]
        core.kill()
        core.wait(timeout=30)

        seen = await drain_until_closed(busy, timeout=60)
        kinds = [e["type"] for e in seen]
        done = next(e for e in seen if e["type"] == "response.done")
        assert done["frame_id"] == "busy" and done["status"] == "failed", done
        errors = [e["error"]["code"] for e in seen if e["type"] == "error"]
        assert errors and set(errors) == {"engine_error"}, seen
        assert kinds[-1] == "session.closed" and seen[-1]["reason"] == "engine_error", kinds
        for ws in idle:
            seen = await drain_until_closed(ws, timeout=60)
            assert [e["type"] for e in seen] == ["error", "session.closed"], seen
            assert seen[0]["error"]["code"] == "engine_error"
            assert seen[1]["reason"] == "engine_error"

        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "engine_down"
        # New sessions are refused, on both adapters.
        async with websockets.connect(srv.url, subprotocols=SUBPROTOCOLS) as ws:
            assert (await recv(ws))["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.open", "event_id": "late"}))
            seen = await drain_until_closed(ws, timeout=30)
            assert seen[0]["type"] == "error" and seen[0]["error"]["code"] == "engine_error", seen
            assert seen[-1]["type"] == "session.closed" and seen[-1]["reason"] == "engine_error"
        r = await client.post("/v1/streaming/sessions", json={})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
        r = await client.post(
            f"/v1/streaming/sessions/{http_sid}/frame",
            content=jpeg_bytes(2),
            headers={"content-type": "image/jpeg"},
        )
        assert r.status_code in (404, 503), r.text
        assert not srv.hub.sessions
