"""The default CPU KV pool on a machine with little memory: the server starts, sized by the
machine, and says how many default sessions fit (log and /metrics).

The memory figure is injected (EnginePlatform): 256 MiB available to the worker's node. Given no
size, vLLM's CPU worker would ask for 90% of the node's total and refuse to start when that much
is not free; the default gives it an explicit 25% share instead. One dedicated tiny-VLM engine
(the shared ones have explicit pools), with a 64 MiB pool.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.conftest import engine_settings
from tests.realtime.conftest import RunningServer, _serve
from tests.reliability.conftest import capture_logs

pytestmark = pytest.mark.slow

AVAILABLE = 256 << 20


@pytest.fixture(scope="module")
async def small_machine() -> AsyncIterator[tuple[RunningServer, list[str]]]:
    from realtime.engine import EnginePlatform, start_engine

    settings = engine_settings(
        "tiny-qwen2-vl",
        kv_cache_memory_bytes=None,
        extra={"limit_mm_per_prompt": {"image": 1, "video": 1}},
    )
    with capture_logs(("realtime.engine", "vllm_realtime"), logging.INFO) as logs:
        engine: Any = start_engine(settings, EnginePlatform(cuda=False, available_memory=AVAILABLE))
        try:
            async for srv in _serve(engine, None, max_sessions=64):
                yield srv, [r.getMessage() for r in logs.records]
        finally:
            engine.shutdown()


async def test_small_machine_starts_with_a_share_of_its_memory_and_says_what_fits(
    small_machine: tuple[RunningServer, list[str]],
) -> None:
    srv, messages = small_machine
    hub = srv.hub
    engine_line = next(m for m in messages if m.startswith("engine on CPU"))
    # 25% of 256 MiB, passed to vLLM as an explicit size (which vLLM then accepted).
    assert "KV pool 64 MiB = 25% of the 0.25 GiB available to the CPU worker" in engine_line
    # The tiny VLM in float32: 2 layers x 2 KV heads x 32 dims x (K, V) x 4 bytes = 1 KiB per
    # token, so 64 MiB is 65,536 tokens: 2,048 blocks of 32, one of them vLLM's null block.
    assert hub.usable_blocks * hub.block_size == (64 << 20) // 1024 - hub.block_size
    fit = hub.usable_blocks // hub.reservation_blocks()
    assert fit >= 1
    pool_line = next(m for m in messages if m.startswith("KV pool:"))
    assert f"about {fit} such sessions fit (vllm_realtime_default_sessions_fit)" in pool_line
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{srv.http}/metrics")).text
    match = re.search(r"^vllm_realtime_default_sessions_fit (\S+)$", text, re.M)
    assert match is not None and float(match.group(1)) == fit
