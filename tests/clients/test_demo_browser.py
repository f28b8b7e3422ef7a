"""The demo page in a real headless Chromium (fake camera) against the real server and engine."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.clients.conftest import ARTIFACTS, CLIENT_KEY, JS_DIR, ROOT, need, need_tool
from tests.realtime.conftest import RunningServer

pytestmark = pytest.mark.slow

FRAMES = 10
# The page's settings for the tiny model: small frames, a short window and reply.
TINY_PAGE = {"DEMO_FPS": "5", "DEMO_WIDTH": "112", "DEMO_WINDOW": "4", "DEMO_MAX_TOKENS": "4"}


def fresh_screenshot(name: str) -> Path:
    """ARTIFACTS/<name>, with no screenshot of an earlier run left at that path."""
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / name
    shot.unlink(missing_ok=True)
    return shot


async def run_node(script: str, env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    node = need_tool("node", "install Node.js 20+")
    proc = await asyncio.create_subprocess_exec(
        node,
        script,
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def run_demo_page(
    server: RunningServer, tmp_path: Any, timeout: float = 240, **env: str
) -> dict[str, Any]:
    """Run clients/js/e2e/demo.e2e.mjs (the page in headless Chromium, fake camera) against
    `server` with the page settings in `env` (DEMO_* overrides); its summary, once the run
    exited 0 (within `timeout` seconds) with no page or protocol error."""
    chromium = need_tool("chromium", "apt-get install chromium (Debian's package)")
    need(
        (JS_DIR / "node_modules" / "playwright-core").is_dir(),
        "playwright-core is not installed: npm ci --prefix clients/js",
    )
    base = {
        "DEMO_URL": server.http + "/",
        # The page trades it for a client secret, which travels as the subprotocol.
        "DEMO_API_KEY": CLIENT_KEY,
        "DEMO_SCREENSHOT": str(tmp_path / "demo.png"),
        "DEMO_USER_DATA_DIR": str(tmp_path / "chromium-profile"),
        "CHROMIUM": chromium,
    }
    rc, out, err = await run_node(
        str(JS_DIR / "e2e" / "demo.e2e.mjs"), {**base, **env}, timeout=timeout
    )
    assert rc == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    assert summary["pageErrors"] == [] and summary["errors"] == [], summary
    return summary


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
