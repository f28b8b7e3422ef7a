"""The Python SDK's watch-and-ask calls (`ingest_frame`, `ask`, `stream_ask`) against the real
server on the real engine (tiny Qwen2-VL)."""

from __future__ import annotations

import asyncio
import json

import pytest
from vllm_realtime_client import connect
from vllm_realtime_client import sync as sdk_sync

from tests.clients.conftest import CLIENT_KEY
from tests.realtime.conftest import RunningServer, jpeg_bytes

pytestmark = pytest.mark.slow


async def test_ingest_frames_then_ask(client_server: RunningServer) -> None:
    seen: list[str] = []
    async with connect(
        client_server.url, api_key=CLIENT_KEY, on_event=lambda e: seen.append(e.type)
    ) as session:
        await session.open(sampling={"max_tokens": 4})
        for i in range(3):
            done = await session.ingest_frame(jpeg_bytes(i), frame_id=f"f{i}")
            assert done.status == "ingested" and done.text == "" and done.frame_id == f"f{i}"
        assert "response.created" not in seen and "response.text.delta" not in seen
        stream = session.stream_ask("What happened?", frame_id="q1")
        deltas = [d.delta async for d in stream]
        assert stream.done is not None and stream.done.frame_id == "q1"
        assert stream.done.status in ("completed", "incomplete")
        assert "".join(deltas) == stream.done.text
        # A structured answer for this question only (the JSON may be cut by max_tokens 4).
        done = await session.ask("Again, as JSON.", response_format={"type": "json_object"})
        assert done.status in ("completed", "incomplete")
        if done.status == "completed":
            json.loads(done.text)
        assert [d.frame_index for d in [stream.done, done]] == [3, 4]


async def test_sync_ingest_and_ask(client_server: RunningServer) -> None:
    def work() -> tuple[str, str, int]:
        with sdk_sync.connect(client_server.url, api_key=CLIENT_KEY) as session:
            session.open(sampling={"max_tokens": 3})
            watched = session.ingest_frame(jpeg_bytes(7), binary=False)
            answer = session.ask("What is there?")
            return watched.status, answer.status, answer.frame_index

    watched, answered, index = await asyncio.to_thread(work)
    assert watched == "ingested" and answered in ("completed", "incomplete") and index == 1
