"""Client tests: the SDK importable from the checkout, and one real server (with an API key);
the webcam script loaded as a module (`webcam`), and the demo page run in headless Chromium
(`run_demo_page`).

The server runs on the shared `vlm_engine` (tests/conftest.py): no extra engine is started.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SDK_DIR = ROOT / "clients" / "python"
JS_DIR = ROOT / "clients" / "js"
WEBCAM = ROOT / "clients" / "webcam" / "webcam.py"
ARTIFACTS = ROOT / "artifacts"
# Appended, not prepended: the repository's own packages (vllm_realtime_protocol, which the SDK
# depends on) keep resolving from the checkout first.
if str(SDK_DIR) not in sys.path:
    sys.path.append(str(SDK_DIR))

from tests.realtime.conftest import RunningServer, _serve  # noqa: E402
from tests.tools import need, need_tool  # noqa: E402  (re-exported to the client tests)

CLIENT_KEY = "client-test-key"


@pytest.fixture(scope="session")
async def client_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    """The real uvicorn app on the tiny VLM, requiring CLIENT_KEY."""
    async for s in _serve(
        vlm_engine, CLIENT_KEY, max_sessions=4, idle_timeout_s=30.0, max_frame_bytes=1 << 20
    ):
        yield s


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("webcam", WEBCAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["webcam"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


webcam = _load()


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
