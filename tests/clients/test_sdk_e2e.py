"""The Python SDK against the real server on the real engine (tiny Qwen2-VL)."""

from __future__ import annotations

import asyncio

import pytest
from vllm_realtime_client import Unauthorized, UndecodableFrame, connect
from vllm_realtime_client import sync as sdk_sync

from tests.clients.conftest import CLIENT_KEY
from tests.realtime.conftest import RunningServer, jpeg_bytes

pytestmark = pytest.mark.slow


async def test_frames_replies_retention_and_clean_close(client_server: RunningServer) -> None:
    seen: list[str] = []
    async with connect(
        client_server.url, api_key=CLIENT_KEY, on_event=lambda e: seen.append(e.type)
    ) as session:
        opened = await session.open(
            instructions="Describe each frame.",
            retention={"window_chunks": 4},
            sampling={"max_tokens": 4},
        )
        assert opened.config.retention.window_chunks == 4
        assert opened.limits.model == "tiny-qwen2-vl"
        dones = []
        for i in range(3):
            done = await session.append_frame(
                jpeg_bytes(i), prompt="what is this?", frame_id=f"f{i}"
            )
            dones.append(done)
        stream = session.stream_frame(jpeg_bytes(3), frame_id="f3")
        deltas = [d.delta async for d in stream]
        assert stream.done is not None
        dones.append(stream.done)
        assert "".join(deltas) == stream.done.text
        assert [d.frame_index for d in dones] == [0, 1, 2, 3]
        assert [d.frame_id for d in dones] == ["f0", "f1", "f2", "f3"]
        for d in dones:
            assert d.status in ("completed", "incomplete")
            assert d.usage.completion_tokens >= 1 and d.usage.prompt_tokens > 16
            assert d.timing.total_ms is not None and d.timing.total_ms > 0
            assert d.retention.kv_blocks_held >= 1
        # The context grows with each retained frame.
        held = [d.retention.tokens_retained for d in dones]
        assert held == sorted(held) and held[-1] > held[0]
    assert session.closed is not None
    assert (session.closed.reason, session.closed.frames_total) == ("client_closed", 4)
    assert seen[0] == "session.opened" and seen[-1] == "session.closed"
    # Every block the session held goes back to the pool (server-side clean-up is async).
    for _ in range(100):
        if not client_server.hub.sessions:
            break
        await asyncio.sleep(0.05)
    assert not client_server.hub.sessions


async def test_auth_by_subprotocol_and_refusals(client_server: RunningServer) -> None:
    async with connect(client_server.url, api_key=CLIENT_KEY, auth="subprotocol") as session:
        await session.open(sampling={"max_tokens": 2})
        done = await session.append_frame(jpeg_bytes(5), binary=False)
        assert done.status in ("completed", "incomplete")
    for key in ("not-the-key", None):
        with pytest.raises(Unauthorized):
            await connect(client_server.url, api_key=key)


async def test_undecodable_frame_fails_its_reply_and_the_session_lives(
    client_server: RunningServer,
) -> None:
    async with connect(
        client_server.url, api_key=CLIENT_KEY, config={"sampling": {"max_tokens": 2}}
    ) as session:
        # JPEG magic, junk body: accepted (acked), fails in the model's processor.
        bad = await session.append_frame(b"\xff\xd8\xff" + b"junk" * 50)
        assert (bad.status, bad.status_reason) == ("failed", "undecodable_frame")
        good = await session.append_frame(jpeg_bytes(6))
        assert good.frame_index == 1 and good.status in ("completed", "incomplete")
        assert any(isinstance(e, UndecodableFrame) for e in session.errors)


async def test_sync_wrapper_on_the_real_server(client_server: RunningServer) -> None:
    def work() -> list[int]:
        with sdk_sync.connect(client_server.url, api_key=CLIENT_KEY) as session:
            session.open(sampling={"max_tokens": 2})
            indices = [session.append_frame(jpeg_bytes(i)).frame_index for i in range(2)]
            stream = session.stream_frame(jpeg_bytes(9))
            text = "".join(d.delta for d in stream)
            assert stream.done is not None and stream.done.text == text
            indices.append(stream.done.frame_index)
        return indices

    assert await asyncio.to_thread(work) == [0, 1, 2]
