"""session.update on the real server (SmolLM2 text sessions): later chunks sample with the new
settings, fixed settings and a larger reply than admission reserved are refused naming the
field, and the session goes on (the SDK's update(): tests/clients/test_sdk_surface.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import websockets

from tests.realtime.conftest import SUBPROTOCOLS, RunningServer, open_session, recv_until

pytestmark = pytest.mark.slow

STORY = "Tell me a long story about a lighthouse keeper and the sea."


async def ask(ws: Any, text: str) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "frame.append", "text": text}))
    done, _ = await recv_until(ws, "response.done")
    return done


async def update(ws: Any, **fields: Any) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "session.update", "event_id": "u", **fields}))
    answer, _ = await recv_until(ws, "session.updated")
    return answer


async def test_later_chunks_use_the_updated_sampling(text_server: RunningServer) -> None:
    async with websockets.connect(text_server.url, subprotocols=SUBPROTOCOLS) as ws:
        await open_session(ws, modality="text", sampling={"max_tokens": 8, "temperature": 0.0})
        first = await ask(ws, STORY)
        assert first["usage"]["completion_tokens"] == 8  # a long story: no EOS within 8
        updated = await update(ws, sampling={"max_tokens": 2})
        # Only the field sent changed; the rest of the sampling stayed.
        assert updated["config"]["sampling"]["max_tokens"] == 2
        assert updated["config"]["sampling"]["temperature"] == 0.0
        second = await ask(ws, STORY)
        assert second["usage"]["completion_tokens"] == 2
        assert second["frame_index"] == 1  # the same session went on


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"instructions": "Be a pirate."}, "instructions"),
        ({"retention": {"window_chunks": 2}}, "retention"),
        ({"sampling": {"max_tokens": 16}}, "sampling.max_tokens"),  # over what was reserved
        (
            {
                "sampling": {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                    }
                }
            },
            "sampling.response_format",
        ),
    ],
)
async def test_refused_updates_name_the_field_and_change_nothing(
    text_server: RunningServer, fields: dict[str, Any], param: str
) -> None:
    async with websockets.connect(text_server.url, subprotocols=SUBPROTOCOLS) as ws:
        opened = await open_session(ws, modality="text", sampling={"max_tokens": 4})
        await ws.send(json.dumps({"type": "session.update", "event_id": "u1", **fields}))
        err, _ = await recv_until(ws, "error")
        assert err["error"]["code"] == "invalid_request", err
        assert (err["error"]["param"], err["error"]["event_id"]) == (param, "u1")
        assert err["error"]["session_survives"]
        done = await ask(ws, "Hello!")
        assert done["usage"]["completion_tokens"] <= opened["config"]["sampling"]["max_tokens"]
        # A later valid update sees the settings as they were before the refused one.
        updated = await update(ws, sampling={"temperature": 0.5})
        assert updated["config"]["sampling"]["max_tokens"] == 4
        assert updated["config"]["instructions"] is None


async def test_update_before_open_is_session_not_open(text_server: RunningServer) -> None:
    async with websockets.connect(text_server.url, subprotocols=SUBPROTOCOLS) as ws:
        await recv_until(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "sampling": {"temperature": 1.0}}))
        err, _ = await recv_until(ws, "error")
        assert err["error"]["code"] == "session_not_open"
