"""The demo page in a real headless Chromium (fake camera) against the real server and engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.clients.conftest import (
    TINY_PAGE,
    fresh_screenshot,
    run_demo_page,
)
from tests.realtime.conftest import RunningServer

pytestmark = pytest.mark.slow

FRAMES = 10


async def test_demo_page_streams_the_camera_and_shows_replies(
    client_server: RunningServer, tmp_path: Any
) -> None:
    shot = fresh_screenshot("demo.png")
    summary = await run_demo_page(
        client_server, tmp_path, DEMO_FRAMES=str(FRAMES), DEMO_SCREENSHOT=str(shot), **TINY_PAGE
    )
    assert summary["status"] == "streaming" and summary["finalStatus"] == "stopped"
    assert summary["sessions"] == 1 and summary["model"] == "tiny-qwen2-vl"
    # Served by the server, the page connected with a minted client secret, not the key.
    assert summary["secrets"] == 1 and len(client_server.app.state.client_secrets) >= 1  # type: ignore[attr-defined]
    assert summary["video"]["width"] > 0, "the fake camera delivered no video"

    dones = summary["dones"]
    assert len(dones) >= FRAMES
    assert [d["frame_index"] for d in dones] == list(range(len(dones)))
    for d in dones:
        assert d["status"] in ("completed", "incomplete"), d
        assert d["total_ms"] > 0 and d["kv_blocks_held"] >= 1 and d["frames_retained"] >= 1
    # Paced: one frame in flight, so every frame sent got exactly its reply (or is in flight).
    assert summary["sent"] - len(dones) in (0, 1)
    # Every reply is on the page, beside the video, with its own text.
    shown = {(r["session"], r["frame_index"]): r["text"] for r in summary["dom"]}
    for d in dones:
        assert shown[(d["session"], d["frame_index"])] == d["text"]
    assert int(summary["statReplies"]) == len(dones)
    # Both plots drew something beyond background and grid.
    assert summary["plotColours"]["latency"] >= 4 and summary["plotColours"]["retention"] >= 4
    assert shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Stop closed the session on the server too.
    for _ in range(100):
        if not client_server.hub.sessions:
            break
        await asyncio.sleep(0.05)
    assert not client_server.hub.sessions
