"""The Python SDK's surface on the real server (tiny Qwen2-VL engine): the event iterator,
offer_frame, stream_video over a file ffmpeg made, mint_client_secret and the typed sync
wrapper."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest
from vllm_realtime_client import (
    ChunkInFlight,
    InvalidRequestError,
    Unauthorized,
    connect,
    mint_client_secret,
)
from vllm_realtime_client import sync as sdk_sync

from tests.clients.conftest import CLIENT_KEY, need_tool
from tests.realtime.conftest import RunningServer, jpeg_bytes

pytestmark = pytest.mark.slow


async def test_async_for_event_in_session_sees_every_event_in_order(
    client_server: RunningServer,
) -> None:
    async with connect(client_server.url, api_key=CLIENT_KEY) as session:
        seen: list[str] = []

        async def watch() -> None:
            async for event in session:
                seen.append(event.type)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        await session.open(sampling={"max_tokens": 2})
        await session.append_frame(jpeg_bytes(1), prompt="what?")
    await asyncio.wait_for(watcher, 10)  # the iterator ends with the session
    assert seen[0] == "session.opened" and seen[-1] == "session.closed"
    assert seen.index("input.ack") < seen.index("response.created") < seen.index("response.done")


async def test_offer_frame_drops_while_a_reply_runs_and_append_is_refused(
    client_server: RunningServer,
) -> None:
    async with connect(client_server.url, api_key=CLIENT_KEY) as session:
        await session.open(sampling={"max_tokens": 8})
        first = asyncio.create_task(session.offer_frame(jpeg_bytes(2), prompt="what?"))
        for _ in range(200):
            if session.busy:
                break
            await asyncio.sleep(0.005)
        assert session.busy
        assert await session.offer_frame(jpeg_bytes(3)) is None
        with pytest.raises(ChunkInFlight):
            await session.append_frame(jpeg_bytes(3))  # the shared rule: refused, not queued
        done = await first
        assert done is not None and done.frame_index == 0
        assert session.dropped == 1
        after = await session.offer_frame(jpeg_bytes(4))
        assert after is not None and after.frame_index == 1


async def test_stream_video_sends_a_file_at_its_frame_rate(
    client_server: RunningServer, tmp_path: Path
) -> None:
    ffmpeg = need_tool("ffmpeg", "apt-get install ffmpeg")
    clip = tmp_path / "clip.mp4"
    subprocess.run(
        [
            *(ffmpeg, "-loglevel", "error", "-f", "lavfi", "-i", "testsrc=size=224x168:rate=15"),
            *("-t", "2", "-pix_fmt", "yuv420p", str(clip)),
        ],
        check=True,
        timeout=60,
    )
    async with connect(client_server.url, api_key=CLIENT_KEY) as session:
        await session.open(retention={"window_chunks": 2}, sampling={"max_tokens": 2})
        dones = [
            d
            async for d in session.stream_video(
                clip, fps=4, width=112, realtime=False, reply_every=2, prompt="what?"
            )
        ]
    # 2 s at 4 fps: 8 frames, none dropped when paced by the replies; every 2nd one answered.
    assert [d.frame_id for d in dones] == [f"video-{i}" for i in range(8)]
    assert [d.status for d in dones[::2]] == ["ingested"] * 4
    assert all(d.status in ("completed", "incomplete") for d in dones[1::2])
    # Sink + window, rounded out to whole KV blocks: bounded, older frames evicted.
    assert dones[-1].retention.frames_evicted >= 1
    assert dones[-1].retention.frames_retained < 8
    assert session.dropped == 0


async def test_mint_client_secret_opens_a_browser_session(client_server: RunningServer) -> None:
    secret = await mint_client_secret(
        client_server.url, CLIENT_KEY, expires_in_s=30, session={"sampling": {"max_tokens": 2}}
    )
    assert secret.client_secret and 0 < secret.expires_in_s <= 30
    async with connect(client_server.url, api_key=secret.client_secret, auth="subprotocol") as s:
        opened = await s.open()
        assert opened.config.sampling.max_tokens == 2  # the config the secret is bound to
    with pytest.raises(Unauthorized):
        await mint_client_secret(client_server.url, "wrong-key")


async def test_sync_wrapper_is_typed_and_offers_frames(client_server: RunningServer) -> None:
    def work() -> None:  # in a thread: the server runs on this test's event loop
        with sdk_sync.connect(client_server.url, api_key=CLIENT_KEY) as session:
            session.open(sampling={"max_tokens": 2})
            done = session.offer_frame(jpeg_bytes(5), prompt="what?", frame_id="s0")
            assert done is not None and done.frame_id == "s0"
            stream = session.stream_frame(jpeg_bytes(6), frame_id="s1")
            assert "".join(d.delta for d in stream) == stream.text
            assert session.append_frame.__name__ == "append_frame"

    await asyncio.to_thread(work)


async def test_update_changes_later_replies_and_raises_refusals(
    client_server: RunningServer,
) -> None:
    async with connect(client_server.url, api_key=CLIENT_KEY) as session:
        await session.open(sampling={"max_tokens": 6, "temperature": 0.0})
        updated = await session.update(sampling={"max_tokens": 1})
        assert updated.config.sampling.max_tokens == 1
        assert updated.config.sampling.temperature == 0.0  # only the field sent changed
        assert session.config is not None and session.config.sampling.max_tokens == 1
        done = await session.append_frame(jpeg_bytes(7), prompt="what?")
        assert done.usage.completion_tokens == 1
        with pytest.raises(InvalidRequestError) as caught:
            await session.update(sampling={"max_tokens": 50})  # more than admission reserved
        assert caught.value.param == "sampling.max_tokens"
        again = await session.append_frame(jpeg_bytes(8))
        assert again.frame_index == 1
