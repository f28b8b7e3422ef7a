"""The demo page's watch mode and ask box in a real headless Chromium (fake camera) against the
real server and engine: frames are only watched (status "ingested", nothing shown), then one
typed question is answered between two frames, its answer streamed onto the page."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.clients.conftest import TINY_PAGE, fresh_screenshot, run_demo_page
from tests.realtime.conftest import RunningServer

pytestmark = pytest.mark.slow

FRAMES = 8
QUESTION = "What did the camera see?"


async def test_demo_page_watches_then_answers_a_question(
    client_server: RunningServer, tmp_path: Any
) -> None:
    shot = fresh_screenshot("demo-watch.png")
    summary = await run_demo_page(
        client_server,
        tmp_path,
        DEMO_FRAMES=str(FRAMES),
        **TINY_PAGE,
        DEMO_MODE="watch",
        DEMO_QUESTION=QUESTION,
        DEMO_SCREENSHOT=str(shot),
    )
    assert summary["finalStatus"] == "stopped"

    dones = summary["dones"]
    assert [d["frame_index"] for d in dones] == list(range(len(dones)))
    watched = [d for d in dones if d["status"] == "ingested"]
    answers = [d for d in dones if d["question"] is not None]
    assert len(watched) >= FRAMES
    for d in watched:
        assert d["text"] == "" and d["frame_id"].startswith("cam-") and d["question"] is None
    # Exactly the one question, answered (a text chunk between frames), and only it on the page.
    assert len(answers) == 1, answers
    answer = answers[0]
    assert answer["question"] == QUESTION and answer["status"] in ("completed", "incomplete")
    assert answer["frame_id"] == "ask-0"
    assert all(d["status"] == "ingested" for d in dones if d is not answer)
    assert summary["dom"] == [
        {
            "frame_index": answer["frame_index"],
            "frame_id": "ask-0",
            "session": answer["session"],
            "question": QUESTION,
            "text": answer["text"],
        }
    ]
    assert int(summary["statReplies"]) == 1 and int(summary["statWatched"]) == len(watched)
    assert shot.stat().st_size > 20_000

    for _ in range(100):
        if not client_server.hub.sessions:
            break
        await asyncio.sleep(0.05)
    assert not client_server.hub.sessions
