"""Separate budgets on the real engine (tiny VLM, mRoPE): `retention.text_window_tokens` keeps
questions and replies while the frame window evicts frames, and the blocks a session holds stay
within its admission footprint over 1,000 chunks."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import websockets

from retention.vllm_adapter.introspect import retention_state
from tests.realtime.conftest import SUBPROTOCOLS, jpeg_bytes, open_session, recv_until

pytestmark = pytest.mark.slow

RETENTION = {"sink_chunks": 1, "window_chunks": 4, "text_window_tokens": 120}


async def test_text_kept_while_frames_leave_and_blocks_bounded_over_1000_chunks(
    server: Any,
) -> None:
    frames = [base64.b64encode(jpeg_bytes(i)).decode() for i in range(8)]
    async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
        opened = await open_session(ws, retention=RETENTION, sampling={"max_tokens": 3})
        assert opened["config"]["retention"]["text_window_tokens"] == 120
        record = next(iter(server.hub.sessions.values()))
        reserved = record.footprint.blocks
        rid = record.engine_session.request_id
        held: list[int] = []
        checked = 0
        for i in range(1000):
            question = i % 25 == 10
            if question:
                event = {"type": "frame.append", "text": f"Question {i}: what changed?"}
            else:
                event = {"type": "frame.append", "image": frames[i % 8], "reply": False}
            await ws.send(json.dumps(event))
            done, _ = await recv_until(ws, "response.done")
            assert done["status"] == ("incomplete" if question else "ingested") or (
                question and done["status"] == "completed"
            ), (i, done)
            held.append(done["retention"]["kv_blocks_held"])
            assert held[-1] <= reserved, (i, held[-1], reserved)
            if i % 25 == 20 and i > 100:
                # Ten frames after question i - 10: the frame window (4) has evicted the frames
                # around it, the question and its reply are still held (text window 120).
                state = await retention_state(server.hub.engine, rid)
                assert state is not None
                segs = [s for s in state["segment_chunks"] if not s[4]]
                kinds = [s[1] for s in segs]
                frames_held = sum(1 for k in kinds if k == "frame") - 1  # the sink chunk
                assert frames_held <= 4, kinds
                assert "text" in kinds and "reply" in kinds, kinds
                # The question is older than every frame held but the sink.
                first_text = kinds.index("text")
                assert kinds[first_text + 1 :].count("frame") <= 4
                assert state["chunks_evicted"] > 0
                checked += 1
        assert checked >= 30
        # Bounded: the second half holds no more than the first.
        assert max(held[500:]) <= max(held[:500]), (max(held[:500]), max(held[500:]))
