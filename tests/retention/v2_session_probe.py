"""One bounded SmolLM2 session in a fresh process, on the runner `REALTIME_TEST_RUNNER` names.

Run by tests/retention/test_v2_runner.py (once per runner: vLLM decides about Triton once per
process, tests/model_runner_mode.py); prints one ``PROBE {json}`` line: the greedy tokens of
every chunk, the retention counters, which runner class the worker built and, on V2, which
V1 runner patches the worker process carries (none).
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

BUDGET: dict[str, Any] = {
    "sink_chunks": 1,
    "window_chunks": 2,
    "low_watermark_ratio": 0.5,
    "max_position": 200,
    "consolidation": "reprefill",
}


async def run(chunks: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from realtime.engine import start_engine
    from realtime.models import model_dir
    from retention.vllm_adapter.introspect import retention_state
    from tests.conftest import engine_settings
    from tests.retention.text_oracle import Session, chunk_tokens

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir("smollm2-135m-instruct")))
    engine: Any = start_engine(engine_settings("smollm2-135m-instruct", max_num_seqs=2))
    try:
        v1_patches = None
        if RUNNER == "v2":
            (runner,) = await engine.collective_rpc("vllm_realtime_model_runner")
            # plugin.py installs the V1 runner's patches only in a V1 engine's processes.
            (v1_patches,) = await engine.collective_rpc("vllm_realtime_v1_patches")
        else:
            runner = "V1 (vLLM's own worker)"
        session = Session(engine, BUDGET, max_tokens=4)
        replies: list[list[int]] = []
        try:
            for i in range(chunks):
                reply, _ = await session.send(chunk_tokens(tokenizer, i))
                replies.append(reply)
            state = await retention_state(engine, session.request_id)
            assert state is not None
        finally:
            await session.close()
        return {
            "runner": runner,
            "v1_patches": v1_patches,
            "replies": replies,
            "evictions": state["evictions"],
            "consolidations": state["consolidations"],
            "position_cursor": state["position_cursor"],
        }
    finally:
        engine.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = asyncio.run(run(int(sys.argv[1]) if len(sys.argv) > 1 else 12))
    print("PROBE " + json.dumps(report), flush=True)
