"""The newcomer's first look: the demo page in a real headless Chromium, its fake camera
streamed to the real server on the default model of `make run` (smol-qwen2-vl), with the page's
own instructions and prompt. Chromium's fake camera is a yellow pac-man on dark green: the
replies must say green (issue #22)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from realtime.models import DEFAULT_SERVE_MODEL
from tests.clients.conftest import CLIENT_KEY
from tests.clients.test_demo_browser import run_demo_page
from tests.conftest import engine_settings
from tests.realtime.conftest import RunningServer, _serve

pytestmark = pytest.mark.slow

FRAMES = 3


@pytest.fixture(scope="module")
async def default_model_server() -> AsyncIterator[RunningServer]:
    from realtime.engine import start_engine

    engine = start_engine(
        engine_settings(
            DEFAULT_SERVE_MODEL, extra={"limit_mm_per_prompt": {"image": 1, "video": 1}}
        )
    )
    try:
        async for s in _serve(engine, CLIENT_KEY, model_name=DEFAULT_SERVE_MODEL, max_sessions=2):
            yield s
    finally:
        engine.shutdown()


async def test_the_default_model_sees_the_fake_camera_as_green_through_the_page(
    default_model_server: RunningServer, tmp_path: Any
) -> None:
    assert DEFAULT_SERVE_MODEL == "smol-qwen2-vl"
    summary = await run_demo_page(
        default_model_server,
        tmp_path,
        DEMO_FRAMES=str(FRAMES),
        DEMO_FPS="2",
        DEMO_WIDTH="224",  # the page's default
        DEMO_WINDOW="8",  # the page's default
        DEMO_MAX_TOKENS="16",
        DEMO_PROMPT="What do you see?",  # the page's default
    )
    assert summary["model"] == DEFAULT_SERVE_MODEL
    assert summary["video"]["width"] > 0, "the fake camera delivered no video"
    texts = [d["text"] for d in summary["dones"]]
    print("replies:", texts)  # shown with -s: what a newcomer reads
    assert len(texts) >= FRAMES
    # The first reply reads the frame alone; later ones may copy it, so the first must say green.
    assert "green" in texts[0].lower(), texts
    assert sum("green" in t.lower() for t in texts) * 2 > len(texts), texts
