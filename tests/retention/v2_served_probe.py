"""A bounded video session served over the WebSocket, in a fresh process, on the runner
`REALTIME_TEST_RUNNER` names (tests/model_runner_mode.py).

Run by tests/retention/test_v2_runner.py once per runner; prints one ``PROBE {json}`` line:
each frame's reply text and retention numbers, and whether every KV block was back at close.
The server is the real one (`tests/realtime/conftest._serve` over `start_engine`, tiny Qwen2-VL
as the shared `vlm_engine`), the frames real JPEGs through a real WebSocket.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from tests.model_runner_mode import RUNNER, enter_v2_mode

if RUNNER == "v2":
    enter_v2_mode()

RETENTION: dict[str, Any] = {"sink_chunks": 1, "window_chunks": 4}


async def run(frames: int) -> dict[str, Any]:
    import websockets

    from realtime.engine import start_engine
    from retention.vllm_adapter.introspect import kv_stats
    from tests.conftest import engine_settings
    from tests.realtime.conftest import SUBPROTOCOLS, _serve, image_event, open_session, recv_until

    engine: Any = start_engine(
        engine_settings(
            "tiny-qwen2-vl", max_num_seqs=2, extra={"limit_mm_per_prompt": {"image": 1}}
        )
    )
    replies: list[dict[str, Any]] = []
    try:
        usable = int((await kv_stats(engine))["num_usable_blocks"])
        async for server in _serve(engine, None, max_sessions=2):
            async with websockets.connect(server.url, subprotocols=SUBPROTOCOLS) as ws:
                await open_session(
                    ws,
                    instructions="Describe each frame.",
                    retention=RETENTION,
                    sampling={"max_tokens": 4, "temperature": 0.0},
                )
                for i in range(frames):
                    await ws.send(image_event(i, prompt="what is this?"))
                    done, _ = await recv_until(ws, "response.done", timeout=300)
                    retention = done["retention"]
                    replies.append(
                        {
                            "text": done["text"],
                            "kv_blocks_held": retention["kv_blocks_held"],
                            "frames_retained": retention["frames_retained"],
                            "frames_evicted": retention["frames_evicted"],
                        }
                    )
                await ws.send(json.dumps({"type": "session.close"}))
                await recv_until(ws, "session.closed")
            free = -1
            for _ in range(200):
                free = int((await kv_stats(engine))["num_free_blocks"])
                if free == usable and not server.hub.sessions:
                    break
                await asyncio.sleep(0.05)
        runner = "V1 (vLLM's own worker)"
        if RUNNER == "v2":
            (runner,) = await engine.collective_rpc("vllm_realtime_model_runner")
        return {"runner": runner, "replies": replies, "all_blocks_free": free == usable}
    finally:
        engine.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = asyncio.run(run(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
    print("PROBE " + json.dumps(report), flush=True)
