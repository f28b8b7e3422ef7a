"""Client tests: the SDK importable from the checkout, and one real server (with an API key).

The server runs on the shared `vlm_engine` (tests/conftest.py): no extra engine is started.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

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
from tests.tools import need, need_tool  # noqa: E402, F401  (re-exported to the client tests)

CLIENT_KEY = "client-test-key"


@pytest.fixture(scope="session")
async def client_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    """The real uvicorn app on the tiny VLM, requiring CLIENT_KEY."""
    async for s in _serve(
        vlm_engine, CLIENT_KEY, max_sessions=4, idle_timeout_s=30.0, max_frame_bytes=1 << 20
    ):
        yield s
