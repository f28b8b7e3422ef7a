"""The Python SDK's resilient sessions against the real server (issue #20): a dropped socket is
resumed behind the caller's back, and a drained server is left for a new session on the server
that replaces it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from vllm_realtime_client import connect

from tests.realtime.conftest import RunningServer, _serve, free_port, jpeg_bytes
from tests.reliability.conftest import wait_quiescent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
async def resilient_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    async for s in _serve(vlm_engine, None, max_sessions=4, max_resume_grace_s=30.0):
        yield s


async def test_a_drop_mid_reply_is_resumed_and_the_call_still_returns(
    resilient_server: RunningServer,
) -> None:
    srv = resilient_server
    before = await wait_quiescent(srv)
    seen: list[str] = []
    async with connect(srv.url, on_event=lambda e: seen.append(e.type), retry_backoff=0.1) as s:
        await s.open(resumable={"grace_s": 20}, sampling={"max_tokens": 32})
        assert s.resilient
        sid = s.session_id
        assert (await s.append_frame(jpeg_bytes(0), frame_id="f0")).frame_index == 0
        stream = s.stream_frame(jpeg_bytes(1), frame_id="f1")
        await stream.__anext__()  # the first delta: the reply runs
        s._ws.transport.abort()  # the network drops under the reply
        done = await stream.result()
        assert done.frame_index == 1 and done.frame_id == "f1"
        assert done.status in ("completed", "incomplete")
        assert s.resumes == 1 and s.generation == 1 and s.session_id == sid
        assert "session.resumed" in seen
        # And the session goes on where it was.
        assert (await s.append_frame(jpeg_bytes(2), frame_id="f2")).frame_index == 2
        # A drop while idle: the next call resumes first.
        s._ws.transport.abort()
        assert (await s.append_frame(jpeg_bytes(3))).frame_index == 3
        assert s.resumes == 2
    assert await wait_quiescent(srv) == before


async def test_a_drain_moves_the_session_to_the_restarted_server(vlm_engine: object) -> None:
    port = free_port()
    first = _serve(vlm_engine, None, port=port, max_sessions=4, drain_timeout_s=30.0)
    srv = await first.__anext__()
    async with connect(srv.url, retry_backoff=0.2, max_retries=20) as s:
        await s.open(resumable={"grace_s": 20}, sampling={"max_tokens": 48})
        old_id = s.session_id
        stream = s.stream_frame(jpeg_bytes(0), frame_id="before")
        await stream.__anext__()
        drain = asyncio.create_task(srv.app.state.drain())  # type: ignore[attr-defined]
        # The reply in flight finishes on the draining server.
        done = await stream.result()
        assert done.frame_id == "before" and done.status in ("completed", "incomplete")
        await asyncio.wait_for(drain, 30)
        # The server goes away and a new one comes up on the same port (a restart).
        with pytest.raises(StopAsyncIteration):
            await first.__anext__()
        restarted = _serve(vlm_engine, None, port=port, max_sessions=4)
        srv2 = await restarted.__anext__()
        try:
            # The next chunk waits for the new session, then goes to it.
            after = await s.append_frame(jpeg_bytes(1), frame_id="after", timeout=60)
            assert after.frame_index == 0 and after.frame_id == "after"
            assert s.generation == 2 and s.session_id != old_id
            assert s.session_id in srv2.hub.sessions
        finally:
            await s.close()
            with pytest.raises(StopAsyncIteration):
                await restarted.__anext__()
